"""keel: fine-tuning and continued pretraining of LLMs from one YAML config."""

__version__ = "0.1.0"
