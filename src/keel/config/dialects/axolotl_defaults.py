"""Axolotl's top-level settings that keel has no key for, with their default values. Set to
its default, such a key asks for nothing Axolotl would do differently from keel (a feature
off: Q-GaLore, ReLoRA, LISA, Ray, OpenTelemetry, sample generation; a packing or saving
detail keel does its own way), so it is ignored; set to anything else it is refused
(keel.config.dialects.axolotl). `mean_resizing_embeddings` is not here: its default (new
embedding rows drawn at random) differs from keel's (the mean of the known rows)."""

from __future__ import annotations

THEIR_DEFAULTS: dict[str, object] = {
    "dion_rank_fraction": 1.0,
    "dion_rank_multiple_of": 1,
    "generate_samples": False,
    "generation_do_sample": True,
    "generation_max_new_tokens": 50,
    "generation_prompt_ratio": 0.5,
    "generation_temperature": 0.7,
    "include_tkps": True,
    "layer_offloading": False,
    "lisa_layers_attribute": "model.layers",
    "load_best_model_at_end": False,
    "merge_method": "memory_efficient",
    "num_generation_samples": 3,
    "otel_metrics_host": "localhost",
    "otel_metrics_port": 8000,
    "profiler_steps_start": 0,
    "qgalore_cos_threshold": 0.4,
    "qgalore_gamma_proj": 2,
    "qgalore_proj_bits": 4,
    "qgalore_proj_group_size": 256,
    "qgalore_proj_quant": True,
    "qgalore_proj_type": "std",
    "qgalore_queue_size": 5,
    "qgalore_rank": 256,
    "qgalore_scale": 0.25,
    "qgalore_update_proj_gap": 200,
    "qlora_sharded_model_loading": False,
    "ray_num_workers": 1,
    "relora_prune_method": "magnitude",
    "sample_packing_bin_size": 200,
    "sample_packing_group_size": 100000,
    "save_safetensors": True,
    "shuffle_before_merging_datasets": False,
    "tiled_mlp_use_original_mlp": True,
    "tokenizer_save_jinja_files": True,
    "use_otel_metrics": False,
    "use_ray": False,
}
