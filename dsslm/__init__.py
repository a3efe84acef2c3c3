"""dsslm: distributed pretraining of small language models that resumes exactly."""
__version__ = "0.1.0"
