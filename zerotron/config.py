"""Typed configuration tree for zerotron (DESIGN contract 6).

Sections: ``model``, ``parallel``, ``train``, ``data``, ``lora``, ``preference``, ``checkpoint``, ``log``,
``fault``.
Every field has a help text (``metadata["help"]``) that ``zerotron train --help-config`` prints. This module imports no
``torch.distributed`` and no torch at all, so ``zerotron plan`` and config checks run anywhere.

Loading (YAML/JSON files, dotted overrides, DeepSpeed ``ds_config.json`` mapping) and validation live
in :mod:`zerotron.config_load` and :mod:`zerotron.config_check`; this module only declares the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from zerotron.presets import PRESETS


def _f(default: Any, help: str) -> Any:  # noqa: A002 - "help" is the natural name here
    """A dataclass field with a help text."""
    if isinstance(default, (list, dict)):
        factory: Any = lambda d=default: type(d)(d)  # noqa: E731 - a fresh copy per instance
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder. Field names follow Hugging Face's ``LlamaConfig``."""

    preset: Optional[str] = _f("tiny", f"named architecture: {', '.join(PRESETS)}; None with model.path")
    path: Optional[str] = _f(
        None, "Hugging Face directory or GGUF file to load architecture and weights from"
    )
    hidden_size: int = _f(128, "width of the residual stream")
    num_hidden_layers: int = _f(4, "number of transformer blocks")
    num_attention_heads: int = _f(4, "query heads per layer")
    num_key_value_heads: Optional[int] = _f(None, "key/value heads (GQA); None means num_attention_heads")
    head_dim: Optional[int] = _f(None, "per-head width; None means hidden_size // num_attention_heads")
    intermediate_size: int = _f(352, "MLP inner width")
    vocab_size: int = _f(259, "vocabulary size (tokens)")
    pad_vocab_to_multiple_of: int = _f(
        1,
        "pad the embedding and output rows to a multiple of this times parallel.tp (Megatron's "
        "make-vocab-size-divisible-by; 128 suits GPU kernels; 1 pads only what tp needs); padded rows "
        "get no probability and are not counted, saved or exported",
    )
    max_position_embeddings: int = _f(1024, "longest sequence the model supports")
    rope_theta: float = _f(10000.0, "RoPE base frequency")
    rope_scaling: Optional[dict] = _f(
        None,
        "Llama 3 frequency scaling: {rope_type: llama3, factor, low_freq_factor, "
        "high_freq_factor, original_max_position_embeddings}",
    )
    rms_norm_eps: float = _f(1e-5, "epsilon of RMSNorm")
    tie_word_embeddings: bool = _f(True, "share the input embedding with the output projection")
    attention_bias: bool = _f(False, "bias on the q/k/v projections (Qwen2)")
    mlp: str = _f("gated", "gated (SwiGLU, Llama) or plain (GELU, GPT-style)")
    num_local_experts: int = _f(
        0, "MoE: routed experts per block (Mixtral's name; HF num_experts); 0 is a dense MLP"
    )
    num_experts_per_tok: int = _f(2, "MoE: experts each token is routed to (top-k)")
    moe_intermediate_size: Optional[int] = _f(
        None, "MoE: inner width of each routed expert (Qwen-MoE/OLMoE's name); None means intermediate_size"
    )
    shared_expert_intermediate_size: int = _f(
        0, "MoE: inner width of the always-on shared expert, gated by sigmoid (Qwen2-MoE); 0 is none"
    )
    norm_topk_prob: bool = _f(True, "MoE: renormalise the top-k router probabilities to sum to 1 (Mixtral)")
    router_aux_loss_coef: float = _f(
        0.001, "MoE: weight of the load-balancing loss (Switch/Mixtral form) added to the training loss"
    )
    router_z_loss_coef: float = _f(0.0, "MoE: weight of the router z-loss (ST-MoE: mean logsumexp(logits)^2)")
    scoring_func: str = _f(
        "softmax", "MoE: router scores, softmax (Mixtral, Qwen-MoE, OLMoE) or sigmoid (DeepSeek-V3)"
    )
    routed_scaling_factor: float = _f(1.0, "MoE: factor on the routed experts' weights (DeepSeek-V3: 2.5)")
    router_bias_update_rate: float = _f(
        0.0,
        "MoE: aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for the top-k "
        "choice only, moved by this rate toward balance after each step (0 is off; DeepSeek-V3: 0.001)",
    )
    expert_capacity_factor: float = _f(
        0.0,
        "MoE: 0 is dropless; c > 0 keeps at most ceil(c * seq_len * top_k / experts) tokens per expert and "
        "sequence, dropping the lowest-weighted (they pass through the residual)",
    )
    moe_grouped_gemm: bool = _f(
        True, "MoE: run the experts as one grouped GEMM (torch._grouped_mm) where shapes allow; false loops"
    )
    qk_norm: str = _f(
        "none", "RMSNorm on queries and keys: none, head (per head, Qwen3) or full (whole projection, OLMoE)"
    )
    kv_lora_rank: int = _f(
        0,
        "multi-head latent attention (DeepSeek-V2/V3): rank of the joint key/value down-projection; 0 is "
        "ordinary attention (`zerotron plan` models MLA; the trainer does not build it yet)",
    )
    q_lora_rank: int = _f(0, "MLA: rank of the query down-projection; 0 projects queries directly")
    qk_rope_head_dim: int = _f(0, "MLA: per-head width of the decoupled rotary query/key part")
    qk_nope_head_dim: int = _f(0, "MLA: per-head width of the query/key part without rotary embedding")
    v_head_dim: int = _f(0, "MLA: per-head width of the values; 0 means the query/key head width")
    first_k_dense_replace: int = _f(
        0,
        "MoE: the first k blocks keep a dense MLP of intermediate_size (DeepSeek-V3: 3); `zerotron plan` "
        "models them, the trainer does not build them yet",
    )
    shared_expert_gate: bool = _f(
        True,
        "MoE: a sigmoid gate scales the shared expert (Qwen2-MoE); false adds it ungated (DeepSeek-V3; "
        "`zerotron plan` only)",
    )
    initializer_range: float = _f(0.02, "standard deviation of the normal weight initialisation")
    bos_token_id: Optional[int] = _f(None, "beginning-of-sequence token id, if the tokenizer has one")
    eos_token_id: Optional[int] = _f(None, "end-of-sequence token id")

    @property
    def kv_heads(self) -> int:
        """Key/value head count with the GQA default resolved."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def expert_intermediate(self) -> int:
        """Inner width of each routed expert with the default resolved."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def router_bias(self) -> bool:
        """Whether MoE routers hold the aux-loss-free balancing bias (``mlp.gate.e_score_correction_bias``)."""
        return self.num_local_experts > 0 and self.router_bias_update_rate > 0

    @property
    def dim_per_head(self) -> int:
        """Per-head width with the default resolved."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def padded_vocab(self, tp: int = 1) -> int:
        """Rows of the embedding and output head under ``tp``: vocab_size rounded up to a multiple of
        pad_vocab_to_multiple_of · tp (the rows past vocab_size are padding)."""
        step = max(1, self.pad_vocab_to_multiple_of) * tp
        return -(-self.vocab_size // step) * step


# The fields that decide the parameters' shapes: a checkpoint resumes only into the same values.
ARCHITECTURE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_heads",
    "dim_per_head",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
    "mlp",
    "num_local_experts",
    "expert_intermediate",
    "shared_expert_intermediate_size",
    "router_bias",
    "qk_norm",
)


@dataclass
class ParallelConfig:
    """Degrees of every parallelism; their product is the world size."""

    dp: int = _f(-1, "data-parallel degree; -1 means world_size / (tp*pp*cp)")
    tp: int = _f(1, "tensor-parallel degree (divides attention heads and KV heads)")
    pp: int = _f(1, "pipeline-parallel degree (divides layers)")
    cp: int = _f(1, "context-parallel degree (2*cp divides seq_len: each rank holds two zig-zag chunks)")
    cp_comm: str = _f(
        "ring",
        "context-parallel attention: ring (K/V passed round the ranks), ulysses (all-to-all to heads), "
        "allgather (gather K/V) or hybrid (ulysses inside groups of cp_ulysses_size, ring across)",
    )
    cp_ulysses_size: int = _f(1, "cp_comm=hybrid: ranks of each all-to-all group (divides cp, 1 < size < cp)")
    ep: int = _f(1, "expert-parallel degree, folded over dp*cp")
    etp: int = _f(
        1,
        "expert tensor-parallel degree: 1 keeps every expert whole on each tp rank; tp splits each expert's "
        "intermediate width over the tp ranks (Megatron's expert_tensor_parallel_size)",
    )
    zero: int = _f(0, "ZeRO stage over dp: 0 (DDP), 1 (optimizer states), 2 (+grads), 3 (+params)")
    sequence_parallel: bool = _f(False, "shard LayerNorm/dropout activations over tp (Megatron SP)")
    tp_comm_overlap: bool = _f(
        False,
        "overlap tp collectives with the GEMMs (Megatron/Transformer Engine userbuffers); modelled by "
        "`zerotron plan`, not built in the trainer",
    )
    overlap_param_gather: bool = _f(
        False,
        "ZeRO-1/2: gather the updated shards under the next step's first forward, bucket by bucket "
        "(Megatron-Core's --overlap-param-gather); modelled by `zerotron plan`, not built in the trainer",
    )
    pp_schedule: str = _f("1f1b", "pipeline schedule: gpipe, 1f1b, interleaved or zb")
    virtual_stages: int = _f(1, "model chunks per pipeline rank (interleaved schedule)")
    pp_layers: Optional[list] = _f(
        None, "layers of each pipeline stage, e.g. [3, 5] (pp*virtual_stages entries); None balances by FLOPs"
    )
    offload_optimizer: str = _f("none", "where optimizer states live: none, cpu or nvme")
    offload_params: str = _f("none", "where ZeRO-3 parameters live: none, cpu or nvme")
    offload_grads: str = _f(
        "none",
        "where ZeRO-3's fp32 gradient shards wait for the optimizer step: none (host memory, under "
        "parameter offload) or nvme (a file beside the moments, as DeepSpeed ZeRO-Infinity swaps them; "
        "needs parallel.offload_params and parallel.offload_optimizer=nvme)",
    )
    nvme_path: Optional[str] = _f(None, "directory for NVMe offload files")
    bucket_mb: float = _f(25.0, "gradient all-reduce (ZeRO-1/2: reduce-scatter) bucket size in MiB")
    persist_numel: int = _f(4096, "ZeRO-3: parameters with fewer elements stay whole on every rank")
    reshard_after_forward: bool = _f(
        True, "ZeRO-3: free each module's gathered parameters after its forward (re-gathered for backward)"
    )
    zero_shard_size: int = _f(
        0,
        "hybrid sharding (FSDP's HSDP, DeepSpeed's MiCS; hpZ is zero_hpz_size): ZeRO shards over groups of this many consecutive "
        "data-parallel ranks (a node) and replicates across the groups, whose gradients are all-reduced; "
        "0: shard over all dp ranks",
    )
    grad_reduce_dtype: str = _f(
        "fp32",
        "dtype gradients are reduced in over the data-parallel group: fp32, or bf16 (half the bytes; "
        "ZeRO-2/3 still accumulate the reduced shards in fp32)",
    )
    zero_quantized_weights: bool = _f(
        False,
        "ZeRO-3 (ZeRO++'s qwZ): all-gathers send the working weights as block int8 (one fp32 maximum per "
        "zero_quantized_weight_block elements), about a quarter of fp32's bytes; the masters stay exact",
    )
    zero_quantized_gradients: bool = _f(
        False,
        "ZeRO-1/2/3 (ZeRO++'s qgZ): gradient reduce-scatters send block-quantised gradients by all-to-all "
        "(zero_quantized_gradient_bits, one fp32 maximum per zero_quantized_gradient_block elements), "
        "dequantised and summed in fp32 by the receiving rank",
    )
    zero_quantized_gradient_bits: int = _f(8, "zero_quantized_gradients: 8 (int8) or 4 (int4) bits")
    zero_quantized_weight_block: int = _f(2048, "zero_quantized_weights: elements per int8 block")
    zero_quantized_gradient_block: int = _f(
        128,
        "zero_quantized_gradients: elements per block (gradients are heavy-tailed: long blocks round their "
        "small values to zero; 2048 cost the default job 1.5% of loss at int8, 128 none)",
    )
    zero_quantized_gradient_node: int = _f(
        0,
        "zero_quantized_gradients: ranks per node (the GPUs of one machine). Above 1 the reduction runs in "
        "two levels, as ZeRO++'s qgZ does: an all-to-all inside each block of this many consecutive dp "
        "ranks, summed, quantised again, then one across the blocks, so 1/this of the bytes cross "
        "nodes; 1: one level (every rank to every rank); 0 (auto): the launcher's ranks per node "
        "(LOCAL_WORLD_SIZE; zerotron plan: the hardware's GPUs per node) when dp spans several nodes",
    )
    zero_hpz_size: int = _f(
        1,
        "ZeRO-3 (ZeRO++'s hpZ, DeepSpeed's zero_hpz_partition_size): after each unit's forward gather, "
        "keep a second copy of its working weights split over blocks of this many consecutive dp ranks "
        "(a node), so backward's gather stays inside the block; 1: off",
    )
    zero_fp8_gather: str = _f(
        "auto",
        "ZeRO-3 under train.precision=fp8: all-gather the float8 linears' weights as float8 bytes plus one "
        "scale each (torchao's float8 all-gather; half of bf16's bytes, the same numbers), cast with the "
        "whole weight's scale before the gather; auto: wherever it applies (ZeRO-3, fp8, the tensorwise "
        "recipe), always: require it (refused where it cannot), never: gather bf16",
    )
    backend: str = _f("auto", "torch.distributed backend: auto (nccl on GPU, gloo on CPU), nccl or gloo")


@dataclass
class TrainConfig:
    """Optimisation and schedule."""

    steps: int = _f(200, "optimizer steps to run")
    global_batch: int = _f(16, "sequences per optimizer step, over all data-parallel ranks")
    micro_batch: int = _f(4, "sequences per forward/backward on one rank")
    seq_len: int = _f(256, "tokens per sequence")
    lr: float = _f(3e-3, "peak learning rate")
    min_lr: float = _f(3e-4, "learning rate at the end of the decay")
    warmup_steps: int = _f(20, "warm-up steps")
    warmup_type: str = _f("linear", "how warm-up rises: linear, or log (DeepSpeed's default)")
    warmup_min_lr: float = _f(0.0, "learning rate warm-up starts from")
    schedule: str = _f("cosine", "decay after warm-up: cosine, linear or constant")
    schedule_convention: str = _f(
        "zerotron",
        "zerotron: step k runs warm-up step k+1 and reaches train.lr at the last warm-up step; deepspeed: "
        "DeepSpeed's WarmupLR family (step k uses the scheduler's iteration k-1, so step 0 runs at "
        "warmup_min_lr, and warm-up counts at least 2 steps) — set by --deepspeed",
    )
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (not applied to norms and biases)")
    optimizer: str = _f(
        "adamw",
        "adamw, or onebit_adam (1-bit Adam without clipping, data parallelism or ZeRO-1/2, in any "
        "precision: AdamW for train.onebit_freeze_step steps, then the variance frozen and the momentum "
        "(ZeRO: the gradient) averaged over dp as one bit per value), or zero_one_adam (0/1 Adam, data "
        "parallelism or ZeRO-1/2, in fp32 or bf16: the variance updated on ever sparser steps, the other steps' gradients "
        "averaged as bits; after train.zero_one_var_freeze_step local steps with the weights' change "
        "averaged as bits every few steps)",
    )
    zero_one_var_freeze_step: int = _f(
        100, "zero_one_adam: the last step that may update the variance (DeepSpeed's var_freeze_step)"
    )
    zero_one_var_update_scaler: int = _f(
        16, "zero_one_adam: variance updates between doublings of their interval (var_update_scaler)"
    )
    zero_one_local_step_scaler: int = _f(
        32678,
        "zero_one_adam: local steps between doublings of the synchronisation interval (local_step_scaler)",
    )
    zero_one_local_step_clipper: int = _f(
        16, "zero_one_adam: the longest synchronisation interval, in steps (local_step_clipper)"
    )
    onebit_freeze_step: int = _f(
        100, "onebit_adam: full-precision AdamW steps before the variance freezes (DeepSpeed's freeze_step)"
    )
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this value; 0 disables")
    precision: str = _f(
        "fp32",
        "fp32, bf16 (fp32 master weights), fp16 (dynamic loss scaling) or fp8 (the blocks' linears in float8 "
        "through torchao, everything else as bf16; docs/precision.md)",
    )
    fp8_recipe: str = _f(
        "tensorwise",
        "train.precision=fp8: tensorwise (e4m3 forward, e5m2 gradients, one dynamic scale per tensor) or rowwise "
        "(e4m3, one power-of-two scale per row); torchao's recipes",
    )
    fp8_skip: str = _f(
        "",
        "train.precision=fp8: comma-separated fnmatch patterns of block linears kept in bf16 (e.g. "
        "'layers.0.*,*.down_proj', '*.experts.*' for the routed experts); the embedding, head and routers "
        "always are",
    )
    loss_scale_init: float = _f(2.0**16, "fp16: initial loss scale")
    loss_scale_window: int = _f(1000, "fp16: overflow-free steps before the scale doubles")
    recompute: str = _f("none", "activation recomputation: none, selective (attention core) or full")
    compile: bool = _f(
        False,
        "torch.compile each transformer block's forward and the loss (fuses the norms, rotary embedding, "
        "activations and the logits' fp32 softmax; the first step compiles): dense models on data "
        "parallelism (DDP, ZeRO-1/2/3, offload, adapters, recomputation), not with tp, pp, cp, ep or experts",
    )
    exit_step: int = _f(
        0, "stop after this step (checkpointed) although train.steps is larger; 0: run to the end"
    )
    seed: int = _f(1234, "seed for weights, data order and dropout; same weights on any layout")
    sample_every: int = _f(0, "a sample every N steps into samples.jsonl (0: only sample.txt at the end)")
    sample_max_steps: float = _f(
        -1.0,
        "a sample may take at most this many mean steps' time, then stops early (0: no limit; -1: 2 when "
        "parallel.offload_params is set, where each new token reads every layer from its store, else none)",
    )
    sample_prompt: str = _f("def ", "prompt of the generated sample (not empty)")

    @property
    def fp8_skip_patterns(self) -> tuple[str, ...]:
        """``fp8_skip`` as its patterns (empty entries dropped)."""
        return tuple(p.strip() for p in self.fp8_skip.split(",") if p.strip())


@dataclass
class DataConfig:
    """Where tokens come from."""

    source: str = _f(
        "stdlib", "stdlib (Python's own source files), or a path: text file/dir, .jsonl, .bin/.npy"
    )
    tokenizer: str = _f("byte", "byte, a tokenizer.json path, or 'model' (the tokenizer of model.path)")
    text_field: str = _f("text", "JSONL: the field holding a document's text")
    max_files: int = _f(0, "stdlib/directory sources: read at most this many files (0: all)")
    max_bytes: int = _f(
        4_000_000, "stdlib/directory sources: stop reading after this many bytes (0: no limit)"
    )
    token_dtype: str = _f("uint16", ".bin sources: integer dtype of the token file")
    format: str = _f(
        "pretrain",
        "pretrain (documents concatenated into windows, every token counted), or supervised samples one "
        "per row of .jsonl/.json/.csv: auto (detected per row), messages, sharegpt, alpaca, query, text; or "
        "preference: {prompt|messages, chosen, rejected} pairs trained with preference.loss (zerotron dpo); or "
        "prompts: {prompt|messages, ...} rows answered and rewarded online (zerotron grpo)",
    )
    loss_on: str = _f(
        "assistant",
        "supervised data: the tokens the loss counts: assistant, last_turn (the final one) or all",
    )
    template: str = _f(
        "model", "supervised data: the chat template: model (the tokenizer's own), chatml or llama3"
    )
    max_length: int = _f(0, "supervised data: longest sample in tokens (0: train.seq_len)")
    truncation: str = _f(
        "delete",
        "supervised data: a sample over data.max_length is a bad row (delete) or loses its first (left) or "
        "last (right) tokens",
    )
    on_error: str = _f(
        "fatal",
        "supervised data: a bad row (file:line) stops the run (fatal) or is skipped and counted (skip)",
    )
    packing: bool = _f(
        True,
        "supervised data: pack several samples per row (each attends only to itself, positions restart); "
        "false: one sample per row, padded",
    )


# lora.target_modules that is a list of module-name suffixes joined by commas (anything else but
# "all-linear" is a regular expression over the Hugging Face module names)
LORA_NAME_LIST = r"[A-Za-z0-9_]+(,[A-Za-z0-9_]+)*"


@dataclass
class LoraSection:
    """LoRA adapters (PEFT's settings); lora.rank=0 trains every weight."""

    rank: int = _f(0, "adapter rank r; 0: no adapters (every weight trains); zerotron sft's default is 8")
    alpha: float = _f(16.0, "adapter scaling numerator: the update is alpha/rank * B A")
    dropout: float = _f(0.0, "dropout on the adapters' input")
    target_modules: str = _f(
        "all-linear",
        "all-linear (every linear layer but the output head), module-name suffixes joined by commas "
        "(q_proj,v_proj), or a regular expression over the Hugging Face module names",
    )
    use_rslora: bool = _f(False, "scale by alpha/sqrt(rank) (rsLoRA)")
    use_dora: bool = _f(
        False,
        "DoRA: a trained per-row magnitude times the direction of W + s·BA (not with tp or base_bits=4)",
    )
    base_bits: int = _f(0, "0: the frozen base in the training dtype; 4: NF4 (QLoRA)")
    double_quant: bool = _f(True, "NF4 base: quantise the block scales to 8 bits too")


@dataclass
class PreferenceConfig:
    """Preference optimisation (``data.format=preference``, ``zerotron dpo``): the loss over each pair."""

    loss: str = _f(
        "sigmoid",
        "sigmoid (DPO), ipo (IPO, per-token log-ratios as TRL), or simpo (SimPO: length-normalised, no "
        "reference model)",
    )
    beta: float = _f(
        0.1, "how far the policy may move from the reference (DPO's beta, IPO's tau, SimPO's beta)"
    )
    simpo_gamma: float = _f(0.5, "SimPO: the target reward margin gamma")


@dataclass
class GrpoConfig:
    """Online GRPO (``data.format=prompts``, ``zerotron grpo``): rollouts by the serving engine on the
    training ranks, rewards, group-normalised advantages and the clipped policy loss (TRL's names)."""

    group_size: int = _f(4, "completions sampled per prompt (G; TRL's num_generations)")
    max_new_tokens: int = _f(16, "the longest completion, in tokens (TRL's max_completion_length)")
    temperature: float = _f(
        1.0, "sampling temperature of the rollouts; log-probs are of logits / temperature"
    )
    rewards: str = _f(
        "exact_match",
        "comma-separated reward functions, summed: exact_match (the row's answer field), format (grpo."
        "format_regex), length (minus the completion's share of grpo.max_new_tokens), or module:function "
        "called as f(prompt, completion, row) -> float",
    )
    answer_field: str = _f("answer", "the prompt row's field exact_match compares the completion with")
    format_regex: str = _f(r"^\s*\d+\s*$", "the pattern the format reward asks the whole completion to match")
    loss: str = _f(
        "dapo",
        "dapo (token-level: every completion token of the global batch weighs the same), grpo (each "
        "completion's token mean, then the mean), or dr_grpo (token sum over rows x max_new_tokens)",
    )
    scale_rewards: str = _f("group", "advantages divided by the reward std of: group, batch, or none")
    epsilon: float = _f(0.2, "the ratio's clip range below 1 (and above, unless grpo.epsilon_high)")
    epsilon_high: float = _f(0.0, "the clip range above 1 (DAPO's clip-higher, e.g. 0.28); 0: grpo.epsilon")
    beta: float = _f(0.0, "weight of the KL penalty to the reference model (the weights at step 0); 0: none")
    kl_bias_correction: bool = _f(
        True,
        "the KL term times the (differentiable) importance ratio, for the unbiased reverse-KL gradient "
        "(DeepSeek-V3.2; TRL's use_bias_correction_kl)",
    )
    importance_correction: str = _f(
        "none",
        "none, or tis: each token's loss times min(exp(trainer - engine log-prob), grpo.importance_cap) "
        "(for layouts whose engine and trainer log-probs differ; exact ones give 1)",
    )
    importance_cap: float = _f(2.0, "the cap of the tis importance weight")


@dataclass
class CheckpointConfig:
    """When and how many checkpoints are written."""

    every: int = _f(0, "save every N steps (0: only at the end)")
    keep: int = _f(2, "keep the newest K complete checkpoints")
    async_save: bool = _f(
        False,
        "write checkpoint files on a background thread: a step is blocked only while the state is "
        "gathered and copied to host memory; the next save, the end and an error wait for the write",
    )
    io_buffer_mb: float = _f(
        64.0,
        "MiB of an offloaded shard or moment (ZeRO + CPU/NVMe offload) that a save or a resume holds in "
        "memory at once: each is read from its file and written window by window",
    )


@dataclass
class LogConfig:
    """What the run reports."""

    every: int = _f(1, "print a line every N steps when not on a terminal")
    tensorboard: bool = _f(False, "also write TensorBoard event files into the run directory")
    per_rank_metrics: bool = _f(False, "each rank writes metrics.rank{R}.jsonl too")
    progress: str = _f("auto", "auto (a bar on a terminal, lines otherwise), bar, lines or none")


@dataclass
class FaultConfig:
    """Fault tolerance: hang detection, bad steps, fault injection (restarts: ``--max-restarts``)."""

    hang_timeout_s: float = _f(
        300.0,
        "stop the job with a report when no rank has made progress (a step or a collective) for this long; "
        "0 disables",
    )
    first_step_timeout_s: float = _f(
        900.0, "the allowance for start-up (loading, the first step) before hang_timeout_s applies"
    )
    spike_factor: float = _f(
        0.0, "skip a step whose loss exceeds this many times the median of the last 20 steps; 0 disables"
    )
    max_bad_steps: int = _f(
        3,
        "after this many skipped steps in a row (non-finite or spiking loss), stop the attempt: a restart "
        "(--max-restarts) rolls back to the last checkpoint",
    )
    signal_check_every: int = _f(
        10,
        "every this many steps the ranks agree whether a stop signal (SIGTERM, SIGUSR1, SIGINT) arrived, "
        "with one 4-byte all-reduce per mesh axis; the checkpoint and stop come at the first such step",
    )
    inject: str = _f(
        "",
        "test and drill tool, first attempt only: crash:rank=R,step=S | hang:rank=R,step=S | "
        "slow:rank=R,seconds=X | nan:step=S | corrupt_checkpoint:step=S, several joined by ';'",
    )


@dataclass
class Config:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraSection = field(default_factory=LoraSection)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    @property
    def fp8_gathers(self) -> bool:
        """Whether ZeRO-3 gathers the float8 linears' weights as float8 (``parallel.zero_fp8_gather``):
        ``auto`` or ``always`` under ZeRO-3 with ``train.precision=fp8`` and the tensorwise recipe
        (rowwise casts the weight along another axis for each GEMM)."""
        p, t = self.parallel, self.train
        applies = p.zero == 3 and t.precision == "fp8" and t.fp8_recipe == "tensorwise"
        return applies and p.zero_fp8_gather != "never"


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "lora": LoraSection,
    "preference": PreferenceConfig,
    "grpo": GrpoConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
    "fault": FaultConfig,
}
