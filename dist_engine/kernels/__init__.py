"""Native code built on the machine that runs it: the CPU compute kernels (`compute.py`, one
torch extension) and the shared-memory transport (a plain library, see
distributed/shm_exchange.py), built and cached by `build.py`. C++ sources in csrc/."""
