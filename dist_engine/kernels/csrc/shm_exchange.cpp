// All-to-all through shared memory, for EP ranks that share one host (CPU buffers).
//
// A plain C++ library with a C interface (no torch headers: it builds in about a second and
// does not depend on the compute kernels' build); dist_engine/distributed/shm_exchange.py
// loads it with ctypes.
//
// Why: on one host gloo moves every all-to-all over loopback TCP through its own worker
// thread; for the few hundred KB of an MoE dispatch the cost is latency (syscalls, thread
// hand-offs, wake-ups), not bandwidth. Here each rank copies its rows straight into the
// receiver's mailbox in a segment all ranks map, and the receiver copies them out.
//
// Segment layout (one file under /dev/shm, created by rank 0, unlinked once all ranks mapped it):
//   Header | pid[R] | posted[R*R] | taken[R*R] | boxes
// Box (dst, src) carries src's rows for dst: kBuffers slots of (ChunkHeader + slot_bytes).
// posted[dst][src] counts the chunks src has written into that box and taken[dst][src] the
// chunks dst has read; both only grow, each has one writer, and src may write while
// posted - taken < kBuffers. Every call sends at least one chunk on every pair (an empty
// one for zero rows), so every call is a full synchronisation, and each chunk names its call
// and the total size the sender meant: a receiver that expected another call or size fails
// at once with both views instead of reading garbage (ranks whose collectives diverged).
//
// Waiting spins briefly, then yields, then sleeps in short naps; it gives up with an error
// naming the ranks still owed when the collective timeout passes, a peer's process has exited,
// or a peer gave up (aborted_by). Calls on one object must come from one thread at a time.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sched.h>
#include <sstream>
#include <stdexcept>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LOCKSTEP_CPU_RELAX() _mm_pause()
#else
#define LOCKSTEP_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace {

// Builds the message from its parts and throws; the C entry points below turn it into an
// error string for Python.
template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::runtime_error(message.str());
}

#define LOCKSTEP_CHECK(cond, ...) \
  do {                            \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

constexpr uint64_t kMagic = 0x31504b5453434f4cULL;  // "LOCKSTP1"
constexpr int64_t kBuffers = 2;
constexpr size_t kLine = 64;

struct alignas(kLine) Counter {
  std::atomic<uint64_t> value;
};

struct alignas(kLine) Header {
  std::atomic<uint64_t> magic;  // written last by the creator
  uint64_t num_ranks;
  uint64_t slot_bytes;
  std::atomic<int64_t> aborted_by;  // 0, or 1 + the rank that gave up
};

struct alignas(kLine) ChunkHeader {
  uint64_t call;   // the sender's call number (1, 2, ...)
  uint64_t total;  // bytes the sender sends this receiver in this call
  uint64_t offset;
  uint64_t bytes;
};

struct alignas(kLine) Pid {
  std::atomic<int64_t> value;
};

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

class ShmExchange {
 public:
  ShmExchange(const std::string& path, bool create, int64_t rank, int64_t num_ranks,
              int64_t slot_bytes, double timeout_s)
      : path_(path), rank_(rank), num_ranks_(num_ranks), timeout_s_(timeout_s) {
    LOCKSTEP_CHECK(num_ranks >= 1 && rank >= 0 && rank < num_ranks, "bad rank ", rank, " of ",
                num_ranks);
    LOCKSTEP_CHECK(slot_bytes >= 4096, "slot_bytes must be >= 4096, got ", slot_bytes);
    LOCKSTEP_CHECK(timeout_s > 0, "timeout_s must be > 0");
    slot_bytes_ = round_up(static_cast<size_t>(slot_bytes), kLine);
    const size_t pairs = static_cast<size_t>(num_ranks * num_ranks);
    pid_offset_ = round_up(sizeof(Header), kLine);
    posted_offset_ = pid_offset_ + sizeof(Pid) * num_ranks;
    taken_offset_ = posted_offset_ + sizeof(Counter) * pairs;
    boxes_offset_ = round_up(taken_offset_ + sizeof(Counter) * pairs, 4096);
    slot_stride_ = sizeof(ChunkHeader) + slot_bytes_;
    size_ = boxes_offset_ + pairs * kBuffers * slot_stride_;

    int fd = create ? ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600)
                    : ::open(path.c_str(), O_RDWR);
    LOCKSTEP_CHECK(fd >= 0, "cannot open shared-memory segment ", path, ": ", std::strerror(errno));
    if (create) {
      // posix_fallocate reserves the pages now: a full /dev/shm fails here with ENOSPC, not
      // later with SIGBUS inside a collective.
      int err = ::posix_fallocate(fd, 0, static_cast<off_t>(size_));
      if (err != 0) {
        ::close(fd);
        ::unlink(path.c_str());
        fail("cannot allocate ", size_, " bytes for ", path, ": ",
                    std::strerror(err));
      }
    } else {
      struct stat st;
      LOCKSTEP_CHECK(::fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == size_,
                  "shared-memory segment ", path, " has the wrong size (ranks disagree on "
                  "num_ranks or slot_bytes)");
    }
    void* base = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int map_errno = errno;
    ::close(fd);
    LOCKSTEP_CHECK(base != MAP_FAILED, "cannot map ", path, ": ", std::strerror(map_errno));
    base_ = static_cast<char*>(base);
    if (create) {
      header()->num_ranks = num_ranks;
      header()->slot_bytes = slot_bytes_;
      header()->aborted_by.store(0, std::memory_order_relaxed);
      header()->magic.store(kMagic, std::memory_order_release);
    } else {
      LOCKSTEP_CHECK(header()->magic.load(std::memory_order_acquire) == kMagic &&
                      header()->num_ranks == static_cast<uint64_t>(num_ranks) &&
                      header()->slot_bytes == slot_bytes_,
                  "shared-memory segment ", path, " was made for another group");
    }
    pid(rank_).value.store(::getpid(), std::memory_order_release);
  }

  ~ShmExchange() { close(); }

  void close() {
    if (base_ != nullptr) {
      ::munmap(base_, size_);
      base_ = nullptr;
    }
  }

  void unlink() { ::unlink(path_.c_str()); }

  // Marks the group as failed by this rank: every peer's current or next call raises.
  void abort() { give_up(); }

  // -1 while no rank has given up, else the rank that did.
  int64_t aborted_by() const {
    int64_t who = header()->aborted_by.load(std::memory_order_acquire);
    return who == 0 ? -1 : who - 1;
  }

  std::vector<int64_t> pids() const {
    std::vector<int64_t> out(num_ranks_);
    for (int64_t r = 0; r < num_ranks_; ++r) out[r] = pid(r).value.load(std::memory_order_acquire);
    return out;
  }

  // A buffer of rows: `rows` rows of `row_bytes` bytes each, back to back.
  struct Rows {
    void* data;
    int64_t rows;
  };

  // output/input: contiguous rows of one element type and width (`row_bytes`, checked by the
  // caller); splits in rows, empty for equal splits, as torch.distributed.all_to_all_single.
  void all_to_all(Rows output, Rows input, uint64_t row_bytes,
                  const std::vector<int64_t>& output_splits,
                  const std::vector<int64_t>& input_splits) {
    LOCKSTEP_CHECK(base_ != nullptr, "the shared-memory exchange is closed");
    const int64_t who = header()->aborted_by.load(std::memory_order_acquire);
    LOCKSTEP_CHECK(who == 0, "shared-memory all-to-all: rank ", who - 1,
                   " gave up on the group earlier (see its error)");
    try {
      exchange(output, input, row_bytes, output_splits, input_splits);
    } catch (...) {
      give_up();  // this rank leaves the call: its peers must not wait for their timeout
      throw;
    }
  }

 private:
  void exchange(Rows output, Rows input, uint64_t row_bytes,
                const std::vector<int64_t>& output_splits,
                const std::vector<int64_t>& input_splits) {
    const std::vector<uint64_t> send = byte_splits(input.rows, row_bytes, input_splits, "input");
    const std::vector<uint64_t> recv =
        byte_splits(output.rows, row_bytes, output_splits, "output");
    const char* src_base = static_cast<const char*>(input.data);
    char* dst_base = static_cast<char*>(output.data);
    const std::vector<uint64_t> send_at = starts(send);
    const std::vector<uint64_t> recv_at = starts(recv);
    const uint64_t call = ++calls_;
    const int64_t R = num_ranks_;

    LOCKSTEP_CHECK(send[rank_] == recv[rank_], "rank ", rank_, " sends itself ", send[rank_],
                " bytes but expects ", recv[rank_]);
    if (send[rank_] > 0) {
      std::memcpy(dst_base + recv_at[rank_], src_base + send_at[rank_], send[rank_]);
    }
    // Bytes still to send to / receive from each peer; a pair owes at least one chunk.
    std::vector<uint64_t> sent(R, 0), got(R, 0);
    std::vector<char> send_open(R, 1), recv_open(R, 1);
    send_open[rank_] = recv_open[rank_] = 0;
    int64_t open_count = 2 * (R - 1);

    Waiter waiter(timeout_s_);
    while (open_count > 0) {
      bool progressed = false;
      for (int64_t i = 1; i < R; ++i) {
        const int64_t dst = (rank_ + i) % R;
        if (!send_open[dst]) continue;
        Counter& posted = counter(posted_offset_, dst, rank_);
        const uint64_t n = posted.value.load(std::memory_order_relaxed);
        if (n - counter(taken_offset_, dst, rank_).value.load(std::memory_order_acquire) >=
            static_cast<uint64_t>(kBuffers)) {
          continue;  // both slots still hold chunks dst has not read
        }
        char* slot = slot_ptr(dst, rank_, n % kBuffers);
        auto* head = reinterpret_cast<ChunkHeader*>(slot);
        const uint64_t bytes = std::min<uint64_t>(send[dst] - sent[dst], slot_bytes_);
        head->call = call;
        head->total = send[dst];
        head->offset = sent[dst];
        head->bytes = bytes;
        if (bytes > 0) {
          std::memcpy(slot + sizeof(ChunkHeader), src_base + send_at[dst] + sent[dst], bytes);
        }
        // A full fence, not only release: large memcpys may use non-temporal stores.
        std::atomic_thread_fence(std::memory_order_seq_cst);
        posted.value.store(n + 1, std::memory_order_release);
        sent[dst] += bytes;
        if (sent[dst] == send[dst]) {
          send_open[dst] = 0;
          --open_count;
        }
        progressed = true;
      }
      for (int64_t i = 1; i < R; ++i) {
        const int64_t src = (rank_ - i + R) % R;
        if (!recv_open[src]) continue;
        Counter& taken = counter(taken_offset_, rank_, src);
        const uint64_t n = taken.value.load(std::memory_order_relaxed);
        if (counter(posted_offset_, rank_, src).value.load(std::memory_order_acquire) == n) {
          continue;
        }
        const char* slot = slot_ptr(rank_, src, n % kBuffers);
        const auto* head = reinterpret_cast<const ChunkHeader*>(slot);
        if (head->call != call || head->total != recv[src] || head->offset != got[src] ||
            head->bytes > recv[src] - got[src]) {
          const std::string what =
              "shared-memory all-to-all out of step: rank " + std::to_string(rank_) +
              " is in call " + std::to_string(call) + " expecting " + std::to_string(recv[src]) +
              " bytes from rank " + std::to_string(src) + ", which sent a chunk of call " +
              std::to_string(head->call) + " carrying " + std::to_string(head->total) +
              " bytes (the ranks' collectives diverged)";
          fail(what);
        }
        if (head->bytes > 0) {
          std::memcpy(dst_base + recv_at[src] + got[src], slot + sizeof(ChunkHeader),
                      head->bytes);
        }
        got[src] += head->bytes;
        std::atomic_thread_fence(std::memory_order_seq_cst);
        taken.value.store(n + 1, std::memory_order_release);
        if (got[src] == recv[src]) {
          recv_open[src] = 0;
          --open_count;
        }
        progressed = true;
      }
      if (progressed) {
        waiter.reset();
      } else if (waiter.idle()) {
        check_peers(send_open, recv_open, waiter);
      }
    }
  }

  // Spin for kSpin, then yield the core until kYield, then nap kNap at a time (kLongNap past
  // kLong); idle() is true about every kCheck, when the caller looks at its peers and the
  // deadline. Staying awake for the first 2 ms matters on VMs, where waking a halted vCPU
  // (a thread blocked in the kernel) costs milliseconds.
  class Waiter {
   public:
    explicit Waiter(double timeout_s)
        : start_(Clock::now()),
          deadline_(start_ + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(timeout_s))),
          idle_since_(start_),
          next_check_(start_ + kCheck) {}
    void reset() { idle_ = 0; }
    bool idle() {
      if (idle_++ == 0) idle_since_ = Clock::now();
      const Clock::time_point now = Clock::now();
      const auto waited = now - idle_since_;
      if (waited < kSpin) {
        LOCKSTEP_CPU_RELAX();
      } else if (waited < kYield) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(waited < kLong ? kNap : kLongNap);
      }
      if (now < next_check_) return false;
      next_check_ = now + kCheck;
      return true;
    }
    bool expired() const { return Clock::now() > deadline_; }
    double elapsed_s() const {
      return std::chrono::duration<double>(Clock::now() - start_).count();
    }

   private:
    using Clock = std::chrono::steady_clock;
    static constexpr auto kSpin = std::chrono::microseconds(50);
    static constexpr auto kYield = std::chrono::milliseconds(2);
    static constexpr auto kNap = std::chrono::microseconds(50);
    static constexpr auto kLong = std::chrono::milliseconds(100);
    static constexpr auto kLongNap = std::chrono::milliseconds(1);
    static constexpr auto kCheck = std::chrono::milliseconds(20);
    Clock::time_point start_, deadline_, idle_since_, next_check_;
    uint64_t idle_ = 0;
  };

  void check_peers(const std::vector<char>& send_open, const std::vector<char>& recv_open,
                   const Waiter& waiter) {
    const int64_t who = header()->aborted_by.load(std::memory_order_acquire);
    if (who != 0) {
      fail("shared-memory all-to-all: rank ", who - 1,
                  " gave up on the group (see its error)");
    }
    std::string owed;
    for (int64_t r = 0; r < num_ranks_; ++r) {
      if (!send_open[r] && !recv_open[r]) continue;
      owed += (owed.empty() ? "" : ", ") + std::to_string(r);
      const int64_t peer = pid(r).value.load(std::memory_order_acquire);
      if (peer > 0 && process_gone(static_cast<pid_t>(peer))) {
        fail("shared-memory all-to-all: rank ", r, " (pid ", peer,
                    ") has exited");
      }
    }
    if (waiter.expired()) {
      fail("shared-memory all-to-all timed out after ", waiter.elapsed_s(),
                  " s on rank ", rank_, " waiting for rank(s) ", owed);
    }
  }

  // Exited, or a zombie its parent has not reaped yet (kill(pid, 0) still succeeds on those).
  static bool process_gone(pid_t pid) {
    if (::kill(pid, 0) != 0) return errno == ESRCH;
    const std::string path = "/proc/" + std::to_string(pid) + "/stat";
    FILE* file = std::fopen(path.c_str(), "r");
    if (file == nullptr) return false;  // no /proc: trust kill()
    char text[512];
    const size_t n = std::fread(text, 1, sizeof(text) - 1, file);
    std::fclose(file);
    text[n] = '\0';
    const char* paren = std::strrchr(text, ')');  // the command name may hold spaces
    return paren != nullptr && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X');
  }

  void give_up() {
    int64_t none = 0;
    header()->aborted_by.compare_exchange_strong(none, rank_ + 1, std::memory_order_acq_rel);
  }

  std::vector<uint64_t> byte_splits(int64_t rows, uint64_t row_bytes,
                                    const std::vector<int64_t>& splits, const char* name) const {
    std::vector<uint64_t> out(num_ranks_);
    if (splits.empty()) {
      LOCKSTEP_CHECK(rows % num_ranks_ == 0, name, " has ", rows, " rows, not a multiple of ",
                  num_ranks_, " ranks");
      for (auto& b : out) b = row_bytes * static_cast<uint64_t>(rows / num_ranks_);
      return out;
    }
    LOCKSTEP_CHECK(static_cast<int64_t>(splits.size()) == num_ranks_, name, " splits has ",
                splits.size(), " entries for ", num_ranks_, " ranks");
    int64_t total = 0;
    for (int64_t r = 0; r < num_ranks_; ++r) {
      LOCKSTEP_CHECK(splits[r] >= 0, name, " split ", r, " is negative");
      total += splits[r];
      out[r] = row_bytes * static_cast<uint64_t>(splits[r]);
    }
    LOCKSTEP_CHECK(total == rows, name, " splits sum to ", total, " but it has ", rows, " rows");
    return out;
  }

  static std::vector<uint64_t> starts(const std::vector<uint64_t>& sizes) {
    std::vector<uint64_t> out(sizes.size(), 0);
    for (size_t i = 1; i < sizes.size(); ++i) out[i] = out[i - 1] + sizes[i - 1];
    return out;
  }

  Header* header() const { return reinterpret_cast<Header*>(base_); }
  Pid& pid(int64_t r) const { return reinterpret_cast<Pid*>(base_ + pid_offset_)[r]; }
  Counter& counter(size_t offset, int64_t dst, int64_t src) const {
    return reinterpret_cast<Counter*>(base_ + offset)[dst * num_ranks_ + src];
  }
  char* slot_ptr(int64_t dst, int64_t src, int64_t buffer) const {
    return base_ + boxes_offset_ +
           ((static_cast<size_t>(dst * num_ranks_ + src)) * kBuffers + buffer) * slot_stride_;
  }

  std::string path_;
  int64_t rank_, num_ranks_;
  double timeout_s_;
  size_t slot_bytes_ = 0, pid_offset_ = 0, posted_offset_ = 0, taken_offset_ = 0;
  size_t boxes_offset_ = 0, slot_stride_ = 0, size_ = 0;
  char* base_ = nullptr;
  uint64_t calls_ = 0;
};

}  // namespace

// The C entry points Python calls through ctypes (dist_engine/distributed/shm_exchange.py);
// ctypes releases the GIL for the length of each call. Every function that can fail returns
// 0 on success, or -1 with the reason in `error` (truncated to `error_len`).
namespace {

int report(const std::exception& e, char* error, size_t error_len) {
  if (error != nullptr && error_len > 0) {
    std::strncpy(error, e.what(), error_len - 1);
    error[error_len - 1] = '\0';
  }
  return -1;
}

}  // namespace

extern "C" {

int lockstep_shm_open(const char* path, int create, int64_t rank, int64_t num_ranks,
                      int64_t slot_bytes, double timeout_s, void** handle, char* error,
                      size_t error_len) {
  try {
    *handle = new ShmExchange(path, create != 0, rank, num_ranks, slot_bytes, timeout_s);
    return 0;
  } catch (const std::exception& e) {
    *handle = nullptr;
    return report(e, error, error_len);
  }
}

int lockstep_shm_all_to_all(void* handle, void* output, int64_t output_rows, const void* input,
                            int64_t input_rows, int64_t row_bytes, const int64_t* output_splits,
                            int64_t num_output_splits, const int64_t* input_splits,
                            int64_t num_input_splits, char* error, size_t error_len) {
  try {
    LOCKSTEP_CHECK(row_bytes >= 0 && output_rows >= 0 && input_rows >= 0,
                   "negative row count or width");
    std::vector<int64_t> out_splits(output_splits, output_splits + num_output_splits);
    std::vector<int64_t> in_splits(input_splits, input_splits + num_input_splits);
    static_cast<ShmExchange*>(handle)->all_to_all(
        {output, output_rows}, {const_cast<void*>(input), input_rows},
        static_cast<uint64_t>(row_bytes), out_splits, in_splits);
    return 0;
  } catch (const std::exception& e) {
    return report(e, error, error_len);
  }
}

void lockstep_shm_close(void* handle) { static_cast<ShmExchange*>(handle)->close(); }

void lockstep_shm_free(void* handle) { delete static_cast<ShmExchange*>(handle); }

void lockstep_shm_unlink(void* handle) { static_cast<ShmExchange*>(handle)->unlink(); }

void lockstep_shm_abort(void* handle) { static_cast<ShmExchange*>(handle)->abort(); }

int64_t lockstep_shm_aborted_by(void* handle) {
  return static_cast<ShmExchange*>(handle)->aborted_by();
}

// Writes the process id each rank registered (0 where none yet) into pids[num_ranks].
void lockstep_shm_pids(void* handle, int64_t* pids) {
  const std::vector<int64_t> all = static_cast<ShmExchange*>(handle)->pids();
  std::copy(all.begin(), all.end(), pids);
}

}  // extern "C"
