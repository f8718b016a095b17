"""Every ```python example in `eqx_lean`'s docstrings runs, as a test of its own (`docs` tier).

**Discovery.** Every module under `eqx_lean/` is parsed (not imported) and the docstring of the
module and of each class and function in it, nested ones included, is searched for ```python
fences; each block is one example, with the id `module:qualname` (`#2`, `#3` for a docstring's
later examples), and its traceback points at the docstring's own lines. An independent count
(of the text "```py" in the source files) checks that none is missed, wherever a fence is.

**The namespace.** Each example runs in a fresh namespace holding the imports a reader has
(`PREAMBLE`: `json`, `jax`, `jax.numpy as jnp`, `numpy as np`, `equinox as eqx`, `optax`,
`eqx_lean` and its subpackages with extras, `eqx_lean.hf` and `eqx_lean.lora`), in a scratch
directory that is the working directory (examples name checkpoints by relative paths).

**Preludes.** What a reader would have defined before the example (their `make_block`,
`keys`, a model, a checkpoint at `Mistral-7B-v0.1/`, a loss) comes from the example's prelude
in `PRELUDES`, keyed by the example's id: a function run in the scratch directory that writes
the files the example reads and returns the names it uses, tiny (layers of width 64 at most,
a few layers). A prelude returns exactly the names the example reads before it binds them
(checked against the example's code), so a prelude can neither hide a name the example forgot
to define nor leave one it uses undefined. An example that needs nothing has no prelude.

**Own process.** The examples in `OWN_PROCESS` change process-wide settings and run in a
fresh interpreter (`harness.subprocess_env`) instead; they need no names. The others run in
the test process, with its eight CPU devices and JAX's strict dtype promotion
(`conftest.py`); the ones that plan for GPUs (`"8xh100"`) need the `plan` extra.

Run with `python -m pytest tests/test_docstrings.py -m docs`.
"""

import ast
import builtins
import dataclasses
import json
import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from harness import subprocess_env, without_compilation_cache
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float, PRNGKeyArray

import eqx_lean
import eqx_lean.hf
import eqx_lean.lora


pytestmark = pytest.mark.docs

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "eqx_lean"

PREAMBLE = """\
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_lean
import eqx_lean.hf
import eqx_lean.lora
"""
PREAMBLE_NAMES = {"json", "eqx", "jax", "jnp", "np", "optax", "eqx_lean"}

# Examples that run in a fresh interpreter, and why.
OWN_PROCESS = {
    "eqx_lean._compilation_cache:use_compilation_cache": (
        "it turns JAX's persistent compilation cache on for the rest of its process"
    ),
}


# --- discovery -------------------------------------------------------------------------------

_OPENING = "```python"


@dataclasses.dataclass(frozen=True)
class Example:
    id: str  # "eqx_lean._scan.forward:scan", "...:scan#2" for a docstring's second example
    path: pathlib.Path
    line: int  # of the opening fence, 1-based
    code: str  # dedented

    def compiled(self) -> Any:
        """The code, compiled so that a traceback shows the docstring's own lines."""
        return compile("\n" * self.line + self.code, str(self.path), "exec")


def _docstring_owners(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """`(qualname, node)` of the module (qualname `""`) and of every class and function."""
    yield "", tree

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                qualname = prefix + child.name
                yield qualname, child
                yield from walk(child, qualname + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _examples_in(path: pathlib.Path) -> list[Example]:
    source = path.read_text()
    file_lines = source.splitlines()
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    examples = []
    for qualname, node in _docstring_owners(ast.parse(source)):
        body = getattr(node, "body", [])
        if not (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            continue
        first_line = body[0].value.lineno  # the docstring's first line is the file's
        lines = body[0].value.value.split("\n")
        owner = f"{module}:{qualname}" if qualname else module
        count = 0
        for i, text in enumerate(lines):
            if text.strip() != _OPENING:
                continue
            line = first_line + i
            if file_lines[line - 1].strip() != _OPENING:
                raise ValueError(f"{path}:{line}: the docstring's lines are not the file's")
            end = next(
                (j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), None
            )
            if end is None:
                raise ValueError(f"{path}:{line}: a ```python fence that is never closed")
            count += 1
            examples.append(
                Example(
                    id=owner if count == 1 else f"{owner}#{count}",
                    path=path,
                    line=line,
                    code=textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n",
                )
            )
    return examples


def _sources() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


EXAMPLES = [example for path in _sources() for example in _examples_in(path)]


# --- the names an example reads before it binds them ------------------------------------------


class _FirstUse(ast.NodeVisitor):
    """Collects the names a module's code reads before binding them, in evaluation order (the
    value of an assignment before its targets, a loop's iterable before its body). Names a
    function or lambda binds (its parameters, its assignments) are local to it."""

    def __init__(self) -> None:
        self.bound: set[str] = set()
        self.needed: set[str] = set()

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            if node.id not in self.bound:
                self.needed.add(node.id)
        else:
            self.bound.add(node.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        if isinstance(node.target, ast.Name) and node.target.id not in self.bound:
            self.needed.add(node.target.id)
        self.visit(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.visit(node.target)

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        self.visit(node.target)
        for statement in [*node.body, *node.orelse]:
            self.visit(statement)

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        for alias in node.names:
            self.bound.add((alias.asname or alias.name).split(".")[0])

    visit_ImportFrom = visit_Import

    def _scope(self, bound: set[str], body: list[ast.AST]) -> None:
        outer = set(self.bound)
        self.bound |= bound
        for part in body:
            self.visit(part)
        self.bound = outer

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        arguments = node.args
        for default in [*arguments.defaults, *arguments.kw_defaults]:
            if default is not None:
                self.visit(default)
        names = {
            a.arg
            for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            + [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
        }
        if isinstance(node, ast.Lambda):
            self._scope(names, [node.body])
        else:
            for decorator in node.decorator_list:
                self.visit(decorator)
            self.bound.add(node.name)
            self._scope(names, list(node.body))

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp) -> None:
        outer = set(self.bound)
        for generator in node.generators:
            self.visit(generator.iter)
            self.visit(generator.target)
            for condition in generator.ifs:
                self.visit(condition)
        self.visit(node.elt)
        self.bound = outer

    visit_ListComp = visit_SetComp = visit_GeneratorExp = _comprehension


def names_read(code: str) -> set[str]:
    """The names `code` reads before binding them, but for builtins and the preamble's."""
    visitor = _FirstUse()
    visitor.visit(ast.parse(code))
    return visitor.needed - set(dir(builtins)) - PREAMBLE_NAMES


# --- what the preludes build: the user's models, tiny ----------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """The user's configuration of the examples' `Block` and `Mistral`."""

    dim: int = 64
    vocab: int = 32
    layers: int = 2


class Block(eqx.Module):
    """The user's block: a LayerNorm, an RMSNorm (for the dtype rules' examples, which keep
    either in float32) and a linear layer, with a residual connection."""

    ln: eqx.nn.LayerNorm
    norm: eqx.nn.RMSNorm
    mlp: eqx.nn.Linear

    def __init__(self, config: Config, *, key: PRNGKeyArray):
        self.ln = eqx.nn.LayerNorm(config.dim)
        self.norm = eqx.nn.RMSNorm(config.dim)
        self.mlp = eqx.nn.Linear(config.dim, config.dim, key=key)

    def __call__(
        self,
        x: Float[Array, " dim"],
        mask: Bool[Array, " dim"] | None = None,
        *,
        pos: Float[Array, " dim"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, " dim"]:
        h = jax.nn.gelu(self.mlp(self.norm(self.ln(x))))
        if pos is not None:
            h = h + pos
        if mask is not None:
            h = jnp.where(mask, h, 0.0)
        if key is not None:
            h = eqx.nn.Dropout(0.1)(h, key=key)
        return x + h


def make_block(key: PRNGKeyArray) -> Block:
    return Block(Config(), key=key)


class CachingBlock(eqx.Module):
    """A layer with a cache, as attention has one: `(x, cache) -> (x, cache)`."""

    mlp: eqx.nn.Linear

    def __call__(
        self, x: Float[Array, " dim"], cache: Float[Array, "length dim"]
    ) -> tuple[Float[Array, " dim"], Float[Array, "length dim"]]:
        cache = jnp.concatenate([cache[1:], x[None]])
        return x + jax.nn.gelu(self.mlp(jnp.mean(cache, axis=0))), cache


class BatchBlock(eqx.Module):
    """A layer of a batch, `[batch, dim] -> [batch, dim]`, for LoRA: once adapted, its `mlp` (a
    `LoraLinear`) takes the batch axis itself, so the layer is not `vmap`ped inside `fold`."""

    norm: eqx.nn.RMSNorm
    mlp: eqx.nn.Linear

    def __init__(self, config: Config, *, key: PRNGKeyArray):
        self.norm = eqx.nn.RMSNorm(config.dim)
        self.mlp = eqx.nn.Linear(config.dim, config.dim, key=key)

    def __call__(self, x: Float[Array, "batch dim"]) -> Float[Array, "batch dim"]:
        return x + jax.nn.gelu(self.mlp(jax.vmap(self.norm)(x)))


class Dense(eqx.Module):
    """A layer that takes a batch itself: `[batch, dim] -> [batch, dim]`."""

    weight: Float[Array, "dim dim"]

    def __call__(self, x: Float[Array, "batch dim"]) -> Float[Array, "batch dim"]:
        return jax.nn.relu(x @ self.weight)


class Model(eqx.Module):
    """A model whose layers are `blocks`, for `fit`'s example."""

    blocks: Dense


class Attention(eqx.Module):
    q: eqx.nn.Linear


class MistralBlock(eqx.Module):
    attn: Attention


class Mistral(eqx.Module):
    """The user's Mistral-shaped model of `load_tensors`' example: exactly the four leaves its
    name map names."""

    embed: eqx.nn.Embedding
    blocks: MistralBlock
    norm: eqx.nn.RMSNorm
    head: eqx.nn.Linear

    def __init__(self, config: Config, *, key: PRNGKeyArray):
        embed, blocks, head = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(config.vocab, config.dim, key=embed)
        self.blocks = eqx.filter_vmap(
            lambda k: MistralBlock(
                Attention(eqx.nn.Linear(config.dim, config.dim, use_bias=False, key=k))
            )
        )(jax.random.split(blocks, config.layers))
        self.norm = eqx.nn.RMSNorm(config.dim, use_bias=False)
        self.head = eqx.nn.Linear(config.dim, config.vocab, use_bias=False, key=head)


# The names of `Mistral`'s leaves in its checkpoints, as `load_tensors`' example maps them.
MISTRAL_NAMES = {
    ".embed.weight": "model.embed_tokens.weight",
    ".norm.weight": "model.norm.weight",
    ".head.weight": "lm_head.weight",
    ".blocks.attn.q.weight": "model.layers.{i}.self_attn.q_proj.weight",
}
# Hugging Face's names of a `Block`'s leaves, one layer's (`load_stacked`'s example).
HF_BLOCK = {
    ".ln.weight": "input_layernorm.weight",
    ".ln.bias": "input_layernorm.bias",
    ".norm.weight": "post_attention_layernorm.weight",
    ".norm.bias": "post_attention_layernorm.bias",
    ".mlp.weight": "mlp.up_proj.weight",
    ".mlp.bias": "mlp.up_proj.bias",
}


def mistral_names(path: Any, _: Any) -> str:
    return MISTRAL_NAMES[jax.tree_util.keystr(path)]


def block_names(path: Any, _: Any) -> str:
    return "model.layers.{i}." + HF_BLOCK[jax.tree_util.keystr(path)]


def seed_key(seed: int) -> PRNGKeyArray:
    return jax.random.key(seed)


def layer_keys(count: int) -> PRNGKeyArray:
    return jax.random.split(jax.random.key(0), count)


def write_mistral(path: str, config: Config, files: dict[str, bytes] | None = None) -> None:
    """Saves a `Mistral` under `MISTRAL_NAMES`, with `files` beside it."""
    model = Mistral(config, key=seed_key(1))
    eqx_lean.save_tensors(path, model, mistral_names, files=files)


def tiny_mistral_config() -> eqx_lean.hf.DecoderConfig:
    return eqx_lean.hf.DecoderConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
        max_position_embeddings=64,
        dtype="float32",
    )


def h100s_mesh() -> jax.sharding.Mesh:
    return eqx_lean.memory.target("8xh100").mesh((8,), ("fsdp",))


# --- the preludes, by example id -------------------------------------------------------------

PRELUDES: dict[str, Callable[[], dict[str, Any]]] = {}


def prelude(*ids: str) -> Callable[[Callable[[], dict[str, Any]]], Callable[[], dict[str, Any]]]:
    def register(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        for example_id in ids:
            assert example_id not in PRELUDES, example_id
            PRELUDES[example_id] = fn
        return fn

    return register


@prelude("eqx_lean._build:build_stacked", "eqx_lean._memory.estimates:estimate")
def _block_and_config() -> dict[str, Any]:
    return {"Block": Block, "config": Config()}


@prelude("eqx_lean._build:write_layer")
def _write_layer() -> dict[str, Any]:
    config = Config()
    return {
        "abstract_block": eqx.filter_eval_shape(Block, config, key=seed_key(0)),
        "block_from_my_files": lambda i: Block(config, key=seed_key(i)),
    }


@prelude(
    "eqx_lean._core.dtypes:for_modules",
    "eqx_lean._memory.leaves:describe",
    "eqx_lean._memory.measurements:measure",
    "eqx_lean.quant._linear:quantizing",
)
def _make_block_and_keys() -> dict[str, Any]:
    return {"make_block": make_block, "keys": layer_keys(4)}


@prelude("eqx_lean._init:chunked")
def _key() -> dict[str, Any]:
    return {"key": seed_key(0)}


@prelude("eqx_lean._io.load:checkpoint_tensors")
def _hf_checkpoint() -> dict[str, Any]:
    # A Hugging Face checkpoint of a tiny Mistral: zeros (only its headers are read).
    abstract = eqx_lean.hf.abstract_model(tiny_mistral_config())
    model = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    eqx_lean.hf.save_hf(model, "Mistral-7B-v0.1")
    return {}


@prelude("eqx_lean._io.load:load_tensors")
def _mistral_checkpoint() -> dict[str, Any]:
    config = Config()
    write_mistral("Mistral-7B-v0.1", config)
    return {"Mistral": Mistral, "config": config}


@prelude("eqx_lean._io.load:load_stacked")
def _block_checkpoint() -> dict[str, Any]:
    keys = layer_keys(4)
    eqx_lean.save_stacked("Mistral-7B-v0.1", eqx_lean.build_stacked(make_block, keys), block_names)
    return {"make_block": make_block, "keys": keys, "HF_BLOCK": HF_BLOCK}


@prelude("eqx_lean._io.snapshot:open_checkpoint")
def _checkpoint_with_config() -> dict[str, Any]:
    config = Config()
    write_mistral("checkpoint", config, files={"config.json": json.dumps(vars(config)).encode()})
    return {
        "make_like": lambda c: eqx.filter_eval_shape(Mistral, Config(**c), key=seed_key(0)),
        "names": mistral_names,
    }


@prelude("eqx_lean._memory.load_plans:plan_load")
def _load_to_plan() -> dict[str, Any]:
    config = Config()
    write_mistral("Mistral-7B-v0.1", config)
    return {
        "like": eqx.filter_eval_shape(Mistral, config, key=seed_key(0)),
        "names": mistral_names,
    }


@prelude("eqx_lean._memory.targets:target")
def _step_to_plan() -> dict[str, Any]:
    mesh = h100s_mesh()  # the example's own: a target's meshes of one shape are equal

    def step(params: Array, batch: Array) -> Array:
        grad = jnp.mean(batch, axis=0)
        return params - 1e-3 * grad

    return {
        "step": step,
        "params": jax.ShapeDtypeStruct((64,), jnp.float32, sharding=NamedSharding(mesh, P())),
        "batch": jax.ShapeDtypeStruct(
            (64, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp"))
        ),
    }


@prelude("eqx_lean._memory.training:plan_train_step")
def _lora_train_step() -> dict[str, Any]:
    mesh = h100s_mesh()
    sharding = eqx_lean.fsdp(mesh, "fsdp")

    def make_model() -> Any:
        blocks = eqx_lean.build_stacked(
            lambda k: BatchBlock(Config(), key=k), layer_keys(4), jnp.bfloat16, sharding
        )
        config = eqx_lean.lora.LoraConfig(r=4, target_modules=["mlp"])
        return eqx_lean.lora.add_lora(blocks, config, key=seed_key(1))

    def loss(model: Any, tokens: Array) -> Array:
        y = eqx_lean.fold(model, tokens)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    tokens = jax.ShapeDtypeStruct((8, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    return {"make_model": make_model, "loss": loss, "tokens": tokens}


@prelude("eqx_lean._memory.training:fit")
def _model_to_fit() -> dict[str, Any]:
    mesh = h100s_mesh()
    blocks = jax.ShapeDtypeStruct(
        (4, 64, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "fsdp"))
    )

    def batch(b: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((b, 64), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))

    return {
        "loss": lambda y, target: jnp.mean(jnp.square(y - target)),
        "model": Model(Dense(blocks)),  # pyright: ignore[reportArgumentType]
        "x_struct": batch,
        "y_struct": batch,
    }


@prelude("eqx_lean._scan.forward:scan")
def _blocks_with_cache() -> dict[str, Any]:
    blocks = eqx_lean.build_stacked(
        lambda k: CachingBlock(eqx.nn.Linear(64, 64, key=k)), layer_keys(32)
    )
    return {"blocks": blocks, "x": jnp.ones(64), "cache": jnp.zeros((32, 8, 64))}


@prelude("eqx_lean._scan.forward:scan#2")
def _blocks_with_adapters() -> dict[str, Any]:
    base = eqx_lean.build_stacked(make_block, layer_keys(4))
    config = eqx_lean.lora.LoraConfig(r=4, target_modules=["mlp"])
    blocks = eqx_lean.lora.add_lora(base, config, key=seed_key(1))
    return {
        "blocks": blocks,
        "is_adapter": eqx_lean.lora.lora_filter(blocks),
        "loss": lambda blocks, x: jnp.mean(jnp.square(eqx_lean.fold(blocks, x))),
        "x": jnp.ones(64),
    }


@prelude("eqx_lean._scan.forward:fold")
def _blocks_and_inputs() -> dict[str, Any]:
    return {
        "blocks": eqx_lean.build_stacked(make_block, layer_keys(32)),
        "x": jnp.ones(64),
        "mask": jnp.arange(64) % 2 == 0,
        "pos": jnp.linspace(0.0, 1.0, 64),
        "key": seed_key(2),
    }


@prelude(
    "eqx_lean.hf._plan:plan_lora_step",
    "eqx_lean.hf._plan:plan_train_step",
    "eqx_lean.hf._plan:longest_context",
)
def _config_json() -> dict[str, Any]:
    pathlib.Path("config.json").write_text(json.dumps(tiny_mistral_config().to_hf()))
    return {}


@prelude("eqx_lean._memory.search:longest")
def _decoder_config() -> dict[str, Any]:
    return {"config": tiny_mistral_config()}


@prelude("eqx_lean.lora._lora:add_lora")
def _model_to_adapt() -> dict[str, Any]:
    return {
        "model": eqx_lean.build_stacked(make_block, layer_keys(4)),
        "config": eqx_lean.lora.LoraConfig(r=4, target_modules=["mlp"]),
        "key": seed_key(1),
        "run": eqx_lean.fold,
        "x": jnp.ones(64),
    }


@prelude("eqx_lean.quant._array:quantize")
def _weights_to_quantize() -> dict[str, Any]:
    return {
        "linear": eqx.nn.Linear(64, 64, key=seed_key(0)),
        "blocks": eqx_lean.build_stacked(make_block, layer_keys(4)),
    }


@prelude("eqx_lean.quant._linear:quantize_linears")
def _model_to_quantize() -> dict[str, Any]:
    return {
        "model": eqx_lean.build_stacked(make_block, layer_keys(4)),
        "lora_config": eqx_lean.lora.LoraConfig(r=4, target_modules=["mlp"]),
        "key": seed_key(1),
    }


# --- the tests -------------------------------------------------------------------------------


def test_every_fence_is_an_example():
    """The examples found in docstrings are every ```py fence of the package's source, counted
    as text: a fence outside a docstring (a string constant, a comment), one with a language
    written otherwise (```py, ```python title=...) or one the docstring walk misses would make
    the two counts differ."""
    fences = sum(path.read_text().count("```py") for path in _sources())
    assert fences > 0
    assert len(EXAMPLES) == fences, (len(EXAMPLES), fences)
    assert len({example.id for example in EXAMPLES}) == len(EXAMPLES)


def test_every_prelude_is_for_an_example():
    ids = {example.id for example in EXAMPLES}
    assert set(PRELUDES) <= ids, set(PRELUDES) - ids
    assert set(OWN_PROCESS) <= ids, set(OWN_PROCESS) - ids


@pytest.mark.parametrize("example", EXAMPLES, ids=[example.id for example in EXAMPLES])
def test_example_runs(example: Example, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    needed = names_read(example.code)
    if example.id in OWN_PROCESS:
        assert not needed and example.id not in PRELUDES, "an own-process example has no prelude"
        _run_in_own_process(example, tmp_path)
        return
    given = PRELUDES.get(example.id, dict)()
    assert set(given) == needed, (
        f"{example.path}:{example.line}: the prelude gives {sorted(given)}; "
        f"the example reads {sorted(needed)}"
    )
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(PREAMBLE, namespace)
    namespace.update(given)
    exec(example.compiled(), namespace)
    # JAX dispatches asynchronously: the example's work is done (and its errors raised) here,
    # within its own test.
    jax.block_until_ready(eqx.filter(list(namespace.values()), eqx.is_array))


_RUNNER = "import sys; exec(compile(sys.argv[1], sys.argv[2], 'exec'), {'__name__': '__main__'})"


def _run_in_own_process(example: Example, tmp_path: pathlib.Path) -> None:
    # A reader's machine: no compilation cache set up yet, eqx_lean's default directory (under
    # a scratch XDG_CACHE_HOME), not the test session's.
    env = without_compilation_cache(subprocess_env(XDG_CACHE_HOME=str(tmp_path / "cache")))
    env.pop("EQX_LEAN_COMPILATION_CACHE", None)
    code = PREAMBLE + "\n" * (example.line - PREAMBLE.count("\n")) + example.code
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, code, str(example.path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{example.id} failed:\n{(done.stdout + done.stderr)[-6000:]}"
    if example.id == "eqx_lean._compilation_cache:use_compilation_cache":
        # Where its comment says: one directory for this machine under the default place.
        machines = list((tmp_path / "cache" / "eqx_lean" / "xla").iterdir())
        assert len(machines) == 1 and machines[0].is_dir(), machines
