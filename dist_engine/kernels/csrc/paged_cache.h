// Shared by the attention kernels that read the paged KV cache through raw pointers.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace lockstep {

// Every block the first `context` tokens of sequence `seq` occupy must exist in a cache of
// `num_blocks` blocks: `table` is that sequence's row of `num_columns` block ids.
inline void check_context_blocks(const char* kernel, int64_t seq, const int64_t* table,
                                 int64_t num_columns, int64_t context, int64_t block_size,
                                 int64_t num_blocks) {
  TORCH_CHECK(context <= num_columns * block_size, kernel, ": context length ", context,
              " of sequence ", seq, " outside its block table");
  for (int64_t c = 0; c < (context + block_size - 1) / block_size; ++c) {
    TORCH_CHECK(table[c] >= 0 && table[c] < num_blocks, kernel, ": sequence ", seq,
                " names block ", table[c], " of a cache with ", num_blocks, " blocks");
  }
}

// Ask for the first cache line of each 4 KiB page of [data, data + bytes): a block about to be
// read, at a random place in the pool. The hardware prefetcher streams the rest of a page once
// it sees the first line, but it stops at page boundaries and cannot know where the next block
// is, so each new block started cold. A prefetch never faults: a span that runs past the
// cache's end costs nothing. On the Intel AVX-512 host a decode attention layer over a cache
// that is out of the CPU's caches took 0.79-0.89x the time (0.96-0.99x at 64 KiB blocks) with
// this before each block (docs/benchmark_notes.md); prefetching every line of the block instead
// took 0.87-0.96x cold but 1.07-1.23x when the block was already in cache.
inline void touch_pages(const void* data, int64_t bytes) {
  const char* first = static_cast<const char*>(data);
  for (int64_t offset = 0; offset < bytes; offset += 4096) {
    __builtin_prefetch(first + offset, 0, 3);
  }
}

// touch_pages over one cache block: `block_size` token rows `token_stride` elements apart.
template <typename T>
inline void touch_block(const T* block, int64_t block_size, int64_t token_stride) {
  touch_pages(block, block_size * token_stride * static_cast<int64_t>(sizeof(T)));
}

}  // namespace lockstep
