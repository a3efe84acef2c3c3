import os

# DeepSpeed probes for CUDA at import unless told the accelerator.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# OpenMP threads that sleep when idle, set before torch loads libgomp. By default they spin, and on
# cores shared with other work (other test runs, CI neighbours) the spinning starves the threads
# doing the work: on 2 shared cores, test_wrap, test_loss and test_precision took 77-95 s with
# spinning and 15-16 s without. Scheduling only: no result changes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
