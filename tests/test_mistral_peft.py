"""Which PEFT adapter configurations load, against PEFT 0.21.2 itself (CPU torch).

The oracle is PEFT: its `LoraConfig` fields, the adapters its `get_peft_model` / `save_pretrained`
write for each initialisation, and the logits of `PeftModel.from_pretrained` on a tiny random
`MistralForCausalLM` (float32, eager attention).
"""

import copy
import dataclasses
import json
import os
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_mistral import TINY, forward, hf_logits, hf_model, max_diff, tokens
from test_mistral_lora import fresh_hf

from eqx_lean.hf import DecoderConfig, abstract_model, load_adapters, load_hf, save_hf
from eqx_lean.internal import (
    LORA_TARGETS,
    PEFT_FIELDS,
    from_peft,
    hf_name,
    lora_sites,
    parse_adapter_config,
    to_peft,
)
from eqx_lean.lora import LoraConfig, add_lora


torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

SMALL: dict[str, Any] = dict(TINY, hidden_size=32, intermediate_size=64)  # head_dim 8
ALL = list(LORA_TARGETS)
FILE = "adapters/adapter_config.json"  # a name for messages: parsing reads no file


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> pathlib.Path:
    """A tiny random HF checkpoint directory, written once for the module."""
    path = tmp_path_factory.mktemp("peft") / "base"
    hf_model(seed=0, **SMALL).save_pretrained(path)
    return path


def peft_model(base: pathlib.Path, **settings):
    """PEFT's `get_peft_model` on the base checkpoint with `settings` (CorDA's covariance
    from a few random calibration sequences, one per batch as `preprocess_corda` wants)."""
    model = fresh_hf(base)
    settings = dict(r=4, lora_alpha=8, target_modules=ALL, task_type="CAUSAL_LM") | settings
    config = peft.LoraConfig(**settings)
    if config.init_lora_weights == "corda":
        from peft.tuners.lora.corda import preprocess_corda

        generator = torch.Generator().manual_seed(0)

        def run_model():
            for _ in range(4):
                model(torch.randint(0, SMALL["vocab_size"], (1, 16), generator=generator))

        preprocess_corda(model, config, run_model=run_model)
    return peft.get_peft_model(model, config)


def moved(wrapped, matrices: str = "lora_B"):
    """`wrapped` with each adapter matrix named like `matrices` moved by normal(0, 0.1), as
    training would (several initialisations make B zero, which would hide a wrong load)."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if re.search(matrices, name):
                param.add_(0.1 * torch.randn_like(param))
    return wrapped


def peft_adapter(base: pathlib.Path, out: pathlib.Path, **settings) -> pathlib.Path:
    """A real adapter: [`peft_model`][] with `settings`, B [`moved`][], saved by PEFT."""
    moved(peft_model(base, **settings)).save_pretrained(out)
    return out


def saved_config(path: pathlib.Path) -> dict:
    return json.loads((path / "adapter_config.json").read_text())


def raw(config: dict) -> bytes:
    return json.dumps(config).encode()


def abstract_base():
    """The base model's structure, nothing allocated: what a refused load needs."""
    return abstract_model(DecoderConfig(**SMALL))


def refusal(config: dict, file: str = FILE) -> str:
    with pytest.raises(ValueError) as error:
        parse_adapter_config(raw(config), file)
    return str(error.value)


# --- the table of fields -----------------------------------------------------------------------


def _default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
        # A dataclass as `adapter_config.json` would hold it (`runtime_config`).
        return vars(value) if dataclasses.is_dataclass(value) else value
    return field.default


def test_the_field_table_is_installed_peft_lora_config():
    """Fails when a PEFT upgrade adds, removes, renames or changes the default of a field."""
    installed = [(f.name, _default(f)) for f in dataclasses.fields(peft.LoraConfig)]
    table = [(name, field.default) for name, field in PEFT_FIELDS.items()]
    assert table == installed
    assert [type(d) for _, d in table] == [type(d) for _, d in installed]


def test_a_config_peft_writes_with_its_defaults_loads(tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "down_proj"])
    config.save_pretrained(tmp_path)
    file = tmp_path / "adapter_config.json"
    assert set(json.loads(file.read_text())) <= set(PEFT_FIELDS)
    loaded = parse_adapter_config(file.read_bytes(), str(file))
    assert loaded == LoraConfig(r=4, lora_alpha=16, target_modules=("q_proj", "down_proj"))


def _other_than(default):
    if isinstance(default, bool):
        return not default
    return {"null": "something", '"none"': "all"}.get(json.dumps(default), {"x": 1})


MUST_BE_DEFAULT = [name for name, field in PEFT_FIELDS.items() if field.accepts is None]


@pytest.mark.parametrize("name", MUST_BE_DEFAULT)
def test_fields_not_implemented_must_hold_their_default(name):
    config = dict(to_peft(LoraConfig()), **{name: _other_than(PEFT_FIELDS[name].default)})
    message = refusal(config)
    assert (
        f"adapter config field `{name}` must be {json.dumps(PEFT_FIELDS[name].default)}" in message
    )
    assert FILE in message


@pytest.mark.parametrize("value", [None, False, 0, 0.0, "", [], {}])
def test_unknown_fields_load_when_unset(value):
    config = dict(to_peft(LoraConfig()), future_setting=value)
    assert parse_adapter_config(raw(config), FILE) == LoraConfig()


@pytest.mark.parametrize("value", [True, 1, "on", [0], {"a": None}])
def test_unknown_fields_are_refused_when_set(value):
    message = refusal(dict(to_peft(LoraConfig()), future_setting=value))
    assert "`future_setting` is not a field of PEFT 0.21.2's LoraConfig" in message
    assert f"{FILE} has {json.dumps(value)}" in message


# --- the fields this example implements --------------------------------------------------------

BAD_VALUES = [
    ("lora_dropout", None, "must be a number in [0, 1)"),
    ("lora_dropout", "abc", "must be a number in [0, 1)"),
    ("lora_dropout", 1.0, "must be a number in [0, 1)"),
    ("lora_alpha", True, "must be a positive number"),
    ("lora_alpha", "16", "must be a positive number"),
    ("lora_alpha", 0, "must be a positive number"),
    ("r", True, "must be a positive integer"),
    ("r", 4.0, "must be a positive integer"),
    ("use_rslora", 1, "must be true or false"),
    ("inference_mode", None, "must be true or false"),
    ("task_type", "SEQ_CLS", 'must be "CAUSAL_LM" or null'),
    ("target_modules", None, "must be a non-empty list of module names"),
    ("target_modules", [], "must be a non-empty list of module names"),
    ("corda_config", "ipm", "must be a JSON object or null"),
]


@pytest.mark.parametrize(("name", "value", "requirement"), BAD_VALUES)
def test_bad_values_are_refused_naming_field_file_and_requirement(name, value, requirement):
    message = refusal(dict(to_peft(LoraConfig()), **{name: value}))
    assert message.startswith(f"adapter config field `{name}` {requirement}")
    assert f"{FILE} has {json.dumps(value)}" in message


def test_settings_of_inits_not_used_are_accepted_as_peft_ignores_them():
    """PEFT reads `loftq_config`, `eva_config`, `corda_config` and `lora_ga_config` only for
    their own `init_lora_weights` (and a converted CorDA adapter keeps its `corda_config`)."""
    inert = dict(loftq_config={"loftq_bits": 4}, eva_config={"rho": 2.0}, corda_config={})
    config = dict(to_peft(LoraConfig()), lora_ga_config={"direction": "ArB2r"}, **inert)
    assert parse_adapter_config(raw(config), FILE) == LoraConfig()


def test_a_bad_value_in_a_directory_names_the_file(tmp_path):
    file = tmp_path / "adapter_config.json"
    file.write_text(json.dumps(dict(to_peft(LoraConfig()), lora_dropout=None)))
    model = abstract_base()
    with pytest.raises(ValueError, match="`lora_dropout` must be a number") as error:
        load_adapters(model, tmp_path)
    assert str(file) in str(error.value)


def test_a_truncated_config_is_refused_naming_the_file(tmp_path):
    whole = json.dumps(to_peft(LoraConfig()), indent=2).encode()
    with pytest.raises(ValueError, match=f"{FILE} must be a PEFT adapter config, a complete JSON"):
        parse_adapter_config(whole[: len(whole) // 2], FILE)
    (tmp_path / "adapter_config.json").write_bytes(whole[:-3])
    with pytest.raises(ValueError, match="is not valid JSON") as error:
        load_adapters(abstract_base(), tmp_path)
    assert str(tmp_path / "adapter_config.json") in str(error.value)
    for not_an_object in (b"[1, 2]", b"null"):
        with pytest.raises(ValueError, match=f"{FILE} must hold a JSON object"):
            parse_adapter_config(not_an_object, FILE)


# --- target_modules ----------------------------------------------------------------------------

Q, K, V, OUT = (f".layers.self_attn.{m}_proj" for m in "qkvo")
GATE, UP, DOWN = (f".layers.mlp.{m}_proj" for m in ("gate", "up", "down"))

# Matched against the modules' HF names, layer by layer (on 3 layers): the
# adapted paths, each with its adapted layers (`None`: every layer).
TARGET_FORMS = [
    (["q_proj", "self_attn.v_proj"], {Q: None, V: None}),
    ([f"model.layers.{i}.mlp.down_proj" for i in (1, 0)], {DOWN: (0, 1)}),
    ([f"layers.{i}.self_attn.o_proj" for i in (0, 1, 2)] + ["up_proj"], {OUT: None, UP: None}),
    (["0.self_attn.k_proj"], {K: (0,)}),
    ("all-linear", {p: None for p in (Q, K, V, OUT, GATE, UP, DOWN)}),
    (r"model\.layers\.[02]\.self_attn\.(q|v)_proj", {Q: (0, 2), V: (0, 2)}),
]


def adapted(targets) -> dict:
    config = from_peft(dict(to_peft(LoraConfig()), target_modules=targets))
    base = abstract_model(DecoderConfig(**dict(SMALL, num_hidden_layers=3)))
    model = add_lora(base, config, key=jax.random.key(0), names=hf_name)
    return {path: layer.layers for path, layer in lora_sites(model)}


@pytest.mark.parametrize(("targets", "expected"), TARGET_FORMS)
def test_target_modules_are_read_by_peft_rule(targets, expected):
    got = {jax.tree_util.keystr(path): layers for path, layers in adapted(targets).items()}
    assert got == expected


TARGET_REFUSALS = [
    (["q"], "['q'] name none"),  # PEFT adapts no module named `q` (nor `*.q`)
    (["embed_tokens", "q_proj"], "['embed_tokens'] name none"),  # not a linear layer
    (["model.layers.0.mlp"], "name none"),
    (["model.layers.00.self_attn.q_proj"], "name none"),
    (["model.model.layers.0.self_attn.q_proj"], "name none"),
    (["model.layers.3.self_attn.q_proj"], "name none"),  # the model has layers 0 to 2
    ("embed.*", "must match at least one module"),
]


@pytest.mark.parametrize(("targets", "expected"), TARGET_REFUSALS)
def test_target_modules_that_name_no_module_of_the_model_are_refused(targets, expected):
    with pytest.raises(ValueError) as error:
        adapted(targets)
    message = str(error.value)
    assert message.startswith("`target_modules` must")
    assert expected in message and "model.layers.0.self_attn.q_proj" in message


# --- real PEFT adapters ------------------------------------------------------------------------


def _logits_match_peft(base: pathlib.Path, adapter: pathlib.Path) -> None:
    input_ids = tokens(1, batch=2, seq=16)
    reference = peft.PeftModel.from_pretrained(fresh_hf(base), adapter).eval()
    expected = hf_logits(reference, input_ids)
    assert max_diff(expected, hf_logits(fresh_hf(base), input_ids)) > 1e-2  # adapters matter
    model = load_adapters(load_hf(base, dtype=jnp.float32), adapter)
    with jax.default_matmul_precision("highest"):
        ours = forward(model, jnp.asarray(input_ids))
    # Against PEFT's own model in float64, within twice PEFT's float32 error of it (the
    # standard of test_mistral's parity tests). Not a fixed bound between the two float32
    # results: each rounds by up to about 1e-5 here, and how they add up depends on the CPU's
    # kernels (CorDA's converted adapter: 1.5e-5 apart on an AVX-512 VM, each within 0.7-0.9e-5
    # of float64).
    exact = float64_logits(reference, input_ids)
    assert max_diff(ours, exact) <= 2 * max_diff(expected, exact)


def float64_logits(model, input_ids) -> np.ndarray:
    """`model`'s logits computed in float64 (on a float64 copy; `model` is left as it is)."""
    with torch.no_grad():
        wide = copy.deepcopy(model).double()
        return wide(torch.from_numpy(np.asarray(input_ids, np.int64))).logits.numpy()


def test_all_linear_adapter_loads_with_peft_logits(base, tmp_path):
    adapter = peft_adapter(base, tmp_path / "adapter", target_modules="all-linear")
    written = saved_config(adapter)["target_modules"]
    assert "model.layers.1.self_attn.q_proj" in written and len(written) == 2 * len(ALL)
    _logits_match_peft(base, adapter)


@pytest.mark.parametrize("init", [True, False, "gaussian", "orthogonal"])
def test_adapters_of_inits_that_keep_the_base_load_with_peft_logits(init, base, tmp_path):
    adapter = peft_adapter(base, tmp_path / "adapter", init_lora_weights=init)
    assert saved_config(adapter)["init_lora_weights"] == init
    _logits_match_peft(base, adapter)


def _bitsandbytes_on_cuda() -> bool:
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes") is not None


# LoftQ: PEFT 0.21.2's `loftq_init` needs bitsandbytes and quantizes on "cuda" (or "xpu").
LOFTQ = pytest.mark.skipif(not _bitsandbytes_on_cuda(), reason="LoftQ needs bitsandbytes + CUDA")
INIT_SETTINGS = [
    pytest.param(dict(init_lora_weights="pissa"), id="pissa"),
    pytest.param(dict(init_lora_weights="pissa_niter_4"), id="pissa_niter_4"),
    pytest.param(dict(init_lora_weights="olora"), id="olora"),
    pytest.param(dict(init_lora_weights="mica"), id="mica"),
    pytest.param(dict(init_lora_weights="corda", corda_config=None), id="corda"),
    pytest.param(dict(init_lora_weights="loftq", loftq_config=None), id="loftq", marks=LOFTQ),
]


@pytest.mark.parametrize("settings", INIT_SETTINGS)
def test_adapters_of_inits_that_change_the_base_are_refused(settings, base, tmp_path):
    from peft.tuners.lora.config import CordaConfig

    if "corda_config" in settings:
        settings = dict(settings, corda_config=CordaConfig(corda_method="ipm"))
    if "loftq_config" in settings:
        settings = dict(settings, loftq_config=peft.LoftQConfig(loftq_bits=4, loftq_iter=1))
    adapter = peft_adapter(base, tmp_path / "adapter", **settings)
    init = settings["init_lora_weights"]
    assert saved_config(adapter)["init_lora_weights"] == init
    with pytest.raises(ValueError, match="adapter config field `init_lora_weights` must be") as e:
        load_adapters(load_hf(base, dtype=jnp.float32), adapter)
    message = str(e.value)
    assert f'{adapter / "adapter_config.json"} has "{init}"' in message
    assert "save_pretrained(..., path_initial_model_for_weight_conversion=...)" in message


@pytest.mark.parametrize("init", ["pissa", "olora", "corda"])
def test_adapters_converted_as_the_message_says_load_with_peft_logits(init, base, tmp_path):
    """What the refusal advises: `save_pretrained(..., path_initial_model_for_weight_conversion=)`
    gives a plain adapter on the original base (CorDA's keeps its `corda_config`)."""
    settings = {}
    if init == "corda":
        from peft.tuners.lora.config import CordaConfig

        settings = dict(corda_config=CordaConfig(corda_method="ipm"))
    wrapped = peft_model(base, init_lora_weights=init, **settings)
    wrapped.peft_config["default"].init_lora_weights = True  # PEFT's recipe for the initial
    wrapped.save_pretrained(tmp_path / "initial")
    wrapped.peft_config["default"].init_lora_weights = init
    moved(wrapped, "lora_[AB]").save_pretrained(
        tmp_path / "converted", path_initial_model_for_weight_conversion=str(tmp_path / "initial")
    )
    written = saved_config(tmp_path / "converted")
    assert (written["init_lora_weights"], written["r"]) == (True, 8)
    assert (written["corda_config"] is not None) == (init == "corda")
    _logits_match_peft(base, tmp_path / "converted")


@pytest.mark.parametrize("init", ["eva", "lora_ga", "loftq", "PiSSA", "gaussian_", 1, None])
def test_other_init_values_are_refused(init):
    message = refusal(dict(to_peft(LoraConfig()), init_lora_weights=init))
    assert message.startswith("adapter config field `init_lora_weights` must be true, false")
    assert f"{FILE} has {json.dumps(init)}" in message


def test_a_kasa_adapter_is_refused_by_its_config_field(base, tmp_path):
    adapter = peft_adapter(base, tmp_path / "adapter", kasa_config=peft.KasaConfig())
    model = load_hf(base, dtype=jnp.float32)
    with pytest.raises(ValueError, match="adapter config field `kasa_config` must be null") as e:
        load_adapters(model, adapter)
    assert str(adapter / "adapter_config.json") in str(e.value)
    assert "strict" not in str(e.value)


# --- save_hf -----------------------------------------------------------------------------------


def test_save_hf_refuses_unmerged_adapters(base, tmp_path):
    config = LoraConfig(r=2, target_modules=("q_proj", "down_proj"))
    model = add_lora(load_hf(base, dtype=jnp.float32), config, key=jax.random.key(0))
    with pytest.raises(ValueError, match="unmerged LoRA adapters") as error:
        save_hf(model, tmp_path / "out")
    message = str(error.value)
    assert "self_attn.q_proj" in message and "mlp.down_proj" in message
    assert "`merge_lora(model)`" in message and "`save_adapters(model, path)`" in message
    assert not os.path.exists(tmp_path / "out")
