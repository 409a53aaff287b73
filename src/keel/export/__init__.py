"""`keel export`: a base model plus an adapter or a training checkpoint, merged into one plain
Hugging Face model folder. A consumer of models/ and checkpoint/, like infer/.

The folder is what `AutoModelForCausalLM.from_pretrained` and vLLM load as they are:
safetensors shards (with an index when there are several), config.json,
generation_config.json, the tokenizer and its chat template; for a vision-language model
`AutoModelForImageTextToText`, with the processor files (preprocessor_config.json ...). No adapter files, and nothing
keel-specific is needed to read it.

Where the weights come from (the sources `keel chat` takes, plus training checkpoints):
  --model    HF model dir | bundled:NAME | keel output dir (its final adapter or model)
             | <output.dir>/checkpoints/step-N (on the model the run trained)
  --adapter  PEFT adapter dir | keel output dir of a LoRA run | checkpoints/step-N
A checkpoint holds the trainable weights only (a LoRA adapter, or the trained layers of a
full or freeze run), sharded by torch.distributed.checkpoint across however many processes
trained. They are loaded into the base rebuilt with the run's method, then merged.

Merging is done in fp32 whatever the base's dtype, so W + scale * B @ A is rounded once,
when the result is cast to the output dtype; this needs 4 bytes of memory per parameter.

Modules: sources.py (what --model and --adapter name), merge.py (load, attach, merge and
check), write.py (the request, the output folder), partial_folder.py (write it all at once),
hf_compat.py (keys older transformers readers need). expand.py is `keel expand`, LLaMA Pro's
block expansion, which writes its folder the same way.
"""

from keel.export.write import ExportRequest, export_model

__all__ = ["ExportRequest", "export_model"]
