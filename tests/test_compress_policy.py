"""The TAGC setting: which parameters it selects, its checks, and the --compress parser."""
import jax
import pytest

from jaxodc.compress import Compression, parse_compression, setting_of, tracking_plan
from jaxodc.models.lm import LM, LMConfig
from jaxodc.modeling.units import make_layout


@pytest.fixture(scope="module")
def layout():
    model = LM(LMConfig(d_model=128, n_layers=2, n_heads=4))
    return make_layout(jax.eval_shape(model.init, jax.random.PRNGKey(0)), 2, order=model.unit_names)


def test_default_selects_the_big_non_attention_matrices(layout):
    plan = Compression().plan(layout)
    assert plan.paths == ("embed/Embed_0/embedding", "block_0/down/kernel", "block_0/up/kernel",
                          "block_1/down/kernel", "block_1/up/kernel", "head/out/kernel")
    for unit in layout.units:  # the pieces are exactly those leaves' (offset, size)
        want = [p for path, p in zip(unit.paths, unit.leaf_pieces()) if f"{unit.name}/{path}" in plan.paths]
        assert list(plan.selected(unit.name)) == want
    assert plan.selected_elems() == 327680  # 71% of the model; attention, norms and biases stay dense
    assert tracking_plan(layout).describe() == plan.describe()


def test_predicate_override_and_errors(layout):
    plan = Compression(select=lambda path, shape: path.endswith("qkv/kernel"), fraction=0.1, ratio=4).plan(layout)
    assert plan.paths == ("block_0/qkv/kernel", "block_1/qkv/kernel") and plan.fraction == 0.1
    with pytest.raises(ValueError, match=r"compression 'default': its predicate selects no parameter of the "
                                         r"model \(parameters: embed/Embed_0/embedding\[256, 128\]"):
        Compression(select=lambda path, shape: False).plan(layout)
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\], got 0"):
        Compression(fraction=0)
    with pytest.raises(ValueError, match=r"ratio must be > 1 \(dense bytes / sketch bytes\), got 0.5"):
        Compression(ratio=0.5)
    assert setting_of(None) == {"compression": "off"}
    assert setting_of(plan)["compression"] == "on" and setting_of(plan)["fraction"] == 0.1


def test_parse():
    assert parse_compression("none") is None and parse_compression(None) is None
    assert parse_compression("default") == Compression()
    c = parse_compression("fraction=0.02,ratio=20,seed=3")
    assert (c.fraction, c.ratio, c.seed, c.name) == (0.02, 20.0, 3, "fraction=0.02,ratio=20,seed=3")
    with pytest.raises(ValueError, match="ratio must be a number, got 'x'"):
        parse_compression("ratio=x")
