import json, sys
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
try:
    from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN as M
except Exception as e:
    M = str(e)
for t in ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3", "qwen3_5"]:
    print(t, "conversion:", get_checkpoint_conversion_mapping(t) is not None, "pattern:", M.get(t) if isinstance(M, dict) else M)
sys.path.insert(0, "dev/ref")
import moe_fixtures as mfx
from peft import LoraConfig, get_peft_model
for base, tm in [("qwen3_moe_fused", ["q_proj", "gate_proj", "up_proj", "down_proj"]), ("qwen3_5_moe", ["q_proj", "gate_proj", "up_proj", "down_proj"]), ("qwen3_next", ["k_proj", "gate_proj", "up_proj", "down_proj"])]:
    fam = mfx.FAMILIES[mfx.FIXTURES[base]["family"]]
    m = mfx.load_model(fam, f"tests/models/fixtures/moe/{base}/model")
    try:
        pm = get_peft_model(m, LoraConfig(r=2, lora_alpha=4, target_modules=tm, lora_dropout=0.0))
        c = pm.peft_config["default"]
        print(base, "target_modules", c.target_modules, "target_parameters", c.target_parameters, "rank_pattern", c.rank_pattern, "alpha_pattern", c.alpha_pattern)
        from peft import get_peft_model_state_dict
        print(" keys:", [(k, tuple(v.shape)) for k, v in get_peft_model_state_dict(pm).items() if "layers.1." in k or "layers.0." in k])
        pm.peft_config["default"].save_pretrained("/tmp/probe_" + base)
        print(" saved:", {k: v for k, v in json.load(open(f"/tmp/probe_{base}/adapter_config.json")).items() if k in ("target_modules", "target_parameters", "rank_pattern", "alpha_pattern", "r", "lora_alpha")})
    except Exception as e:
        print(base, "ERROR", e)
