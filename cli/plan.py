"""``kvbm plan``: size the tiers for a model before the first run (bytes per token, blocks, tokens of context)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from kvbm.blocks import ALIGNED_HEADER_LEN, MIN_HEADER_LEN
from kvbm.blocks.layout import DTYPE_BYTES, KVLayout
from kvbm.cli.common import SIZE, CliState, config_option, one_line_errors, pass_state
from kvbm.config.schema import human_bytes
from kvbm.errors import ConfigError
from kvbm.transfer import round_up

_DTYPES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
           "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def layout_from_hf(cfg: dict[str, Any], tp: int, block_bytes: int, dtype: str | None = None,
                   model: str = "") -> KVLayout:
    """The KV layout of rank 0 of ``tp`` for a Hugging Face ``config.json`` (MLA when it has ``kv_lora_rank``)."""
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {"torch_dtype": cfg.get("torch_dtype"), **cfg["text_config"]}  # multimodal models
    try:
        layers = int(cfg["num_hidden_layers"])
        dt = str(dtype or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")
        dt = _DTYPES.get(dt, dt)
        if cfg.get("kv_lora_rank"):  # MLA: one joint latent (+ the decoupled RoPE key) per token and layer
            heads, head = 1, int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
            factor = 1
        else:
            q_heads = int(cfg["num_attention_heads"])
            heads = int(cfg.get("num_key_value_heads") or q_heads)
            head = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // q_heads)
            factor = 2
    except KeyError as e:
        raise ConfigError(f"model config: no {e.args[0]} (need num_hidden_layers, num_attention_heads, "
                          "num_key_value_heads, head_dim or hidden_size, torch_dtype)") from None
    if dt not in DTYPE_BYTES:
        raise ConfigError(f"model config: dtype {dt!r} is not one of {sorted(DTYPE_BYTES)} (use --dtype)")
    return KVLayout(model=model or str(cfg.get("_name_or_path") or "model"), num_layers=layers, num_kv_heads=heads,
                    head_size=head, dtype=dt, kv_factor=factor, tp_size=tp, block_bytes=block_bytes)


def plan(layout: KVLayout, block_bytes: int, capacities: dict[str, int]) -> dict[str, Any]:
    """Blocks and tokens of context per tier. G1 is per GPU (each rank holds its shard); G2-G4 are shared by
    the node's ranks, so a token of context costs ``tp`` blocks' worth there."""
    tp = layout.tp_size
    tpb, payload = layout.block_tokens, layout.block_nbytes
    footprint = {"G1": block_bytes, "G2": block_bytes, "G3": ALIGNED_HEADER_LEN + round_up(payload),
                 "G4": MIN_HEADER_LEN + payload}
    tiers = []
    for name, cap in capacities.items():
        blocks = cap // footprint[name]
        sets = blocks if name == "G1" else blocks // tp
        tiers.append({"tier": name, "capacity_bytes": cap, "block_footprint_bytes": footprint[name],
                      "blocks": blocks, "tokens": sets * tpb, "per": "GPU" if name == "G1" else "node"})
    return {"model": layout.model, "tp": tp, "dtype": layout.dtype, "mla": layout.kv_factor == 1,
            "num_layers": layout.num_layers, "kv_heads_per_rank": layout.kv_heads_per_rank,
            "head_size": layout.head_size, "block_bytes": block_bytes,
            "bytes_per_token_per_rank": layout.bytes_per_token,
            "bytes_per_token": layout.bytes_per_token * tp,  # every rank stores its own shard (or replica)
            "tokens_per_block": tpb, "block_payload_bytes": payload, "tiers": tiers}


def render(rep: dict[str, Any]) -> list[str]:
    lines = [
        f"{rep['model']}: {rep['num_layers']} layers, {rep['kv_heads_per_rank']} KV heads/rank x {rep['head_size']}"
        f"{' (MLA latent)' if rep['mla'] else ''}, {rep['dtype']}, TP={rep['tp']}",
        f"bytes per token: {human_bytes(rep['bytes_per_token_per_rank'])} per rank, "
        f"{human_bytes(rep['bytes_per_token'])} for all {rep['tp']} ranks",
        f"tokens per block: {rep['tokens_per_block']} ({human_bytes(rep['block_payload_bytes'])} of "
        f"{human_bytes(rep['block_bytes'])} per block)",
    ]
    rows = [["tier", "capacity", "blocks", "tokens of context", "per"]]
    for t in rep["tiers"]:
        rows.append([t["tier"], human_bytes(t["capacity_bytes"]), f"{t['blocks']:,}", f"{t['tokens']:,}", t["per"]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append("  " + "  ".join(c.rjust(w) if i in (1, 2, 3) else c.ljust(w)
                                      for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    return lines


@click.command("plan")
@click.option("--model-config", "model_config", required=True, type=click.Path(dir_okay=False, exists=True),
              help="The model's Hugging Face config.json.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--dtype", default=None, help="KV-cache dtype if not the model's (e.g. fp8, bfloat16).")
@click.option("--block-bytes", type=SIZE, default=None, help="Block size (default: the config's block_bytes).")
@click.option("--device", type=SIZE, default=None, help="G1 capacity per GPU (default: the config's).")
@click.option("--host", type=SIZE, default=None, help="G2 host-memory capacity (default: the config's).")
@click.option("--disk", type=SIZE, default=None, help="G3 disk capacity (default: the config's).")
@click.option("--s3", type=SIZE, default=None, help="G4 bucket budget (default: the config's s3.capacity).")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@one_line_errors
@pass_state
def plan_cmd(state: CliState, model_config: str, tp: int, dtype: str | None, block_bytes: int | None,
             device: int | None, host: int | None, disk: int | None, s3: int | None, as_json: bool) -> None:
    """Size the tiers for a model: bytes per token, tokens per block, blocks per tier and how many tokens of
    context each tier holds. Capacities default to the config's (tiers it disables are left out unless
    given here).

    \b
    Example:
      kvbm plan --model-config Llama-3.1-8B/config.json --tp 4 --host 64GiB --disk 2TiB
    """
    cfg = state.config
    try:
        hf = json.loads(Path(model_config).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{model_config}: not valid JSON: {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{model_config}: not a model config (expected a JSON object)")
    bb = block_bytes or cfg.block_nbytes
    layout = layout_from_hf(hf, tp, bb, dtype, model=hf.get("_name_or_path") or Path(model_config).parent.name)
    caps: dict[str, int] = {}
    for name, given, section in (("G1", device, cfg.device), ("G2", host, cfg.host), ("G3", disk, cfg.disk),
                                 ("G4", s3, cfg.s3)):
        if given is not None or section.enabled:
            caps[name] = given if given is not None else section.capacity
    rep = plan(layout, bb, caps)
    click.echo(json.dumps(rep, indent=2) if as_json else "\n".join(render(rep)))
