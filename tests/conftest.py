import os

# DeepSpeed probes for CUDA at import unless told the accelerator.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
