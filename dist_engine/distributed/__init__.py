"""A DP group's processes talking: process groups (`groups.py`), step synchronisation — the
vote, the lock-step check, the settings handshake (`step_sync.py`) —, waking a sleeping group
(`wake.py`), pinning CPU ranks (`cpu_binding.py`), the shared-memory all-to-all
(`shm_exchange.py`) and running a function on every rank of a real group (`spawn.py`)."""
