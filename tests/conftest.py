import hashlib
import os
import sys

# DeepSpeed probes for CUDA at import unless told the accelerator.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# OpenMP threads that sleep when idle, set before torch loads libgomp. By default they spin, and on
# cores shared with other work (other test runs, CI neighbours) the spinning starves the threads
# doing the work: on 2 shared cores, test_wrap, test_loss and test_precision took 77-95 s with
# spinning and 15-16 s without. Scheduling only: no result changes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# DeepSpeed JIT-builds its CPU extension (deepspeed_shm_comm) at each ZeRO engine's start into
# torch's extension cache, one folder per name, with the venv's paths in the build command: a
# second checkout's venv on the same machine (a worktree, CI beside a developer) rebuilt it over
# the first's, and the first rebuilt it back, 60-170 s a time. One cache per venv builds it once.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(
    os.environ.get("DSSLM_CACHE", os.path.expanduser("~/.cache/dsslm")), "torch_extensions",
    hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def no_leaked_process_group():
    """A test that leaves a process group behind fails, and the group is taken down: otherwise the
    next engine built in this process joins it, does not own it, and a later test fails far from
    the cause (test_fsdp's "the engine that made the group took it down" did, in CI)."""
    yield
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test left a torch.distributed process group initialized")
