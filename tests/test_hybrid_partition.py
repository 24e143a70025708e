"""A hybrid target (Qwen3.5-style gated attention + gated DeltaNet) split over the mesh's model axis
on 8 simulated CPU devices: its forward equals the one-device forward, and the compiled program
exchanges no activations between devices (no collective-permute: the gated attention's fused
q | gate, k, v columns are grouped per KV head, so every device holds whole groups; a split of
[q_proj | k_proj | v_proj] as whole parts costs permutes after the projection), only the
Megatron all-reduces. Run in a subprocess: the device-count flag must be set before jax starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from specjax import parallel
from specjax.models.hybrid import HybridLM, hybrid_forward
from specjax.models.hybrid_config import hybrid_config_from_hf
from specjax.models.recurrent_state import HybridState
from specjax.parallel.hlo import collective_counts
cfg = hybrid_config_from_hf(dict(
    model_type="qwen3_5_text", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6,
    layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))
params = nnx.split(HybridLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))[1]
tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 6)), jnp.int32)
f = jax.jit(lambda p, t, s: hybrid_forward(p, cfg, t, s)[0])
ref = f(params, tokens, HybridState.init(cfg, 2, 32))
out = {}
for m in (2,):
  sharded = parallel.place_params(params, parallel.as_mesh(f"data=1,model={m}"), cfg)
  got = f(sharded, tokens, HybridState.init(cfg, 2, 32))
  hlo = f.lower(sharded, tokens, HybridState.init(cfg, 2, 32)).compile().as_text()
  out[m] = {"max_diff": float(jnp.max(jnp.abs(got - ref))), "scale": float(jnp.max(jnp.abs(ref))),
            "collectives": collective_counts(hlo)}
print("RESULT " + json.dumps(out))
"""


def test_hybrid_forward_on_the_model_axis_equals_one_device_and_permutes_nothing():
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": str(ROOT)}
  proc = subprocess.run([sys.executable, "-c", WORKER], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
  line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
  assert line is not None, proc.stderr[-3000:]
  got = json.loads(line[len("RESULT "):])["2"]
  assert got["max_diff"] <= 1e-5 * got["scale"], got
  assert got["collectives"]["collective-permute"] == 0 and got["collectives"]["all-gather"] == 0, got
  assert got["collectives"]["all-reduce"] > 0, got          # the split happened: Megatron's reductions
