"""keel: fine-tuning and continued pretraining of LLMs from one YAML config."""

import logging as _logging

__version__ = "0.1.0"

# peft imports torchao and bitsandbytes whenever they are installed (keel's qlora and bnb
# extras). torchao's import logs a warning for each CUDA kernel library a CPU-only torch
# cannot load, torch one for each of torchao's enums, bitsandbytes one for an optional CPU
# kernel package: lines on every keel command that say nothing about the run. Only these
# loggers' warnings are dropped; their errors still show.
for _name in ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
