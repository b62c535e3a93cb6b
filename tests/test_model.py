"""DLRM shapes, the interaction against a hand computation, config validation, sharding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recsz.model import DLRM, ModelConfig, get_preset, interact_features
from recsz.model.sharding import column_shards, plan_tables
from tests.common import run_without_host_sync


def test_interaction_matches_hand_computation() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, generator=g)
    emb = torch.randn(2, 2, 3, generator=g)
    out = interact_features(x, emb)
    f = [x, emb[:, 0], emb[:, 1]]
    dots = [(f[i] * f[j]).sum(1) for i in range(3) for j in range(i)]  # i > j, row order
    expect = torch.cat([x, torch.stack(dots, 1)], 1)
    torch.testing.assert_close(out, expect)
    assert out.shape == (2, 3 + 3)


def _autograd_interaction(x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """The interaction as plain tensor operations, differentiated by autograd."""
    b, d = x.shape
    feats = torch.cat([x.view(b, 1, d), emb], dim=1)
    n = feats.shape[1]
    li, lj = torch.tril_indices(n, n, offset=-1)
    return torch.cat([x, torch.bmm(feats, feats.transpose(1, 2))[:, li, lj]], dim=1)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 9), t=st.integers(1, 7), d=st.integers(1, 6), seed=st.integers(0, 99))
def test_interaction_gradients_equal_autograds(b: int, t: int, d: int, seed: int) -> None:
    """The interaction's own backward ((G + G^T) F in one product) gives autograd's
    gradients of the plain computation, for both inputs (float64)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d, generator=g, dtype=torch.float64)
    emb = torch.randn(b, t, d, generator=g, dtype=torch.float64)
    w = torch.randn(b, d + (t + 1) * t // 2, generator=g, dtype=torch.float64)
    grads = []
    for f in (interact_features, _autograd_interaction):
        xs, es = x.clone().requires_grad_(), emb.clone().requires_grad_()
        out = f(xs, es)
        (out * w).sum().backward()
        grads.append((out.detach(), xs.grad, es.grad))
    for a, r in zip(*grads, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_interaction_runs_in_the_bottom_outputs_dtype() -> None:
    """Under bfloat16 autocast the products are bfloat16 (x's dtype) and the embeddings'
    gradient comes back float32, within bfloat16's rounding of the float32 one."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, generator=g)
    emb = torch.randn(16, 5, 8, generator=g)
    outs = []
    for dtype in (torch.float32, torch.bfloat16):
        es = emb.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = interact_features(x.to(dtype), es)
        assert out.dtype == dtype
        out.float().square().sum().backward()
        assert es.grad is not None and es.grad.dtype == torch.float32
        outs.append(es.grad)
    assert float((outs[1] - outs[0]).norm() / outs[0].norm()) < 0.02


@pytest.mark.parametrize("preset", ["tiny"])
def test_output_shape(preset: str) -> None:
    cfg = get_preset(preset).model
    m = DLRM(cfg, seed=0)
    dense = torch.rand(5, 13)
    ids = torch.zeros(5, 26, dtype=torch.long)
    assert m(dense, ids).shape == (5,)
    assert m.sparse(ids).shape == (5, 26, cfg.emb_dim)


def test_presets_have_published_shapes() -> None:
    k = get_preset("kaggle")
    assert k.model.emb_dim == 32 and k.model.bottom_mlp == (512, 256, 64, 32)
    assert k.model.top_mlp == (512, 256, 1) and k.batch_size == 128 and k.lr == 0.1
    t = get_preset("terabyte")
    assert t.model.emb_dim == 64 and t.model.top_mlp == (512, 512, 256, 1)
    assert max(t.model.table_sizes) == 10_000_001 and t.batch_size == 2048
    m = get_preset("dcnv2")  # MLPerf's DLRM-DCNv2 reference
    assert m.model.emb_dim == 128 and m.model.bottom_mlp == (512, 256, 128)
    assert m.model.top_mlp == (1024, 1024, 512, 256, 1) and m.model.interaction == "dcn"
    assert (m.model.dcn_layers, m.model.dcn_rank, m.batch_size) == (3, 512, 65536)
    optimizers = (m.lr, m.emb_lr, m.emb_optimizer, m.dense_optimizer)
    assert optimizers == (0.005, 0.005, "rowwise_adagrad", "adagrad")
    # its rows as they are (ids: a preprocessed day's modulo them, as the reference's)
    assert max(m.model.table_sizes) == 40_000_000 and m.model.table_sizes[5] == 3
    assert {get_preset(p).dense_optimizer for p in ("tiny", "bench")} == {"sgd"}


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="end in emb_dim"):
        ModelConfig((10,) * 3, 8, (16, 4), (4, 1))
    with pytest.raises(ValueError, match="end in 1"):
        ModelConfig((10,) * 3, 8, (16, 8), (4, 2))
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("huge")
    with pytest.raises(ValueError, match="interaction 'fm' is not one of"):
        ModelConfig((10,) * 3, 8, (16, 8), (4, 1), interaction="fm")
    from recsz.model import dense_optimizer

    w = torch.nn.Parameter(torch.ones(2))
    assert isinstance(dense_optimizer("adagrad", [w], 0.1), torch.optim.Adagrad)
    assert isinstance(dense_optimizer("sgd", [w], 0.1), torch.optim.SGD)
    with pytest.raises(ValueError, match="dense optimizer 'adam' is not one of"):
        dense_optimizer("adam", [w], 0.1)
    with pytest.raises(ValueError, match="DCN needs a layer and rank 1"):
        ModelConfig((10,) * 3, 8, (16, 8), (4, 1), interaction="dcn", dcn_rank=0)
    from recsz.config import parse_train_args

    run = parse_train_args(["--interaction", "dcn", "--dcn-layers", "2"]).model()
    assert (run.interaction, run.dcn_layers, run.dcn_rank) == ("dcn", 2, 512)
    assert run.table_sizes == get_preset("tiny").model.table_sizes
    mlperf = parse_train_args(["--preset", "dcnv2"])
    assert mlperf.model().interaction == "dcn" and mlperf.resolved("dense_optimizer") == "adagrad"
    dot = parse_train_args(["--preset", "dcnv2", "--interaction", "dot"]).model()
    assert dot.interaction == "dot"
    assert parse_train_args([]).model() == get_preset("tiny").model


def test_out_of_range_id_names_table() -> None:
    m = DLRM(get_preset("tiny").model)
    ids = torch.zeros(2, 26, dtype=torch.long)
    ids[1, 4] = 10**9
    with pytest.raises(IndexError, match="table 4"):
        m(torch.rand(2, 13), ids)


def test_planner_balances_and_is_deterministic() -> None:
    sizes = get_preset("tiny").model.table_sizes
    owners = plan_tables(sizes, 16, 2)
    assert owners == plan_tables(sizes, 16, 2)
    counts = [owners.count(r) for r in range(2)]
    assert abs(counts[0] - counts[1]) <= 4
    mem = [sum(s for s, o in zip(sizes, owners, strict=True) if o == r) for r in range(2)]
    assert max(mem) / sum(mem) < 0.65
    assert plan_tables(sizes, 16, 1) == [0] * 26


def _by_sum_of_shares(sizes: list[int], dim: int, world: int) -> list[int]:
    """The planner before the thirty-fifth session: the rank whose sum of shares (memory,
    tables) would be smallest."""
    n, total = len(sizes), float(sum(sizes)) * dim
    mem, count, owners = [0.0] * world, [0] * world, [0] * n
    for t in sorted(range(n), key=lambda t: (-sizes[t], t)):
        r = min(range(world), key=lambda r: ((mem[r] + sizes[t] * dim) / total
                                             + (count[r] + 1) / n, r))  # fmt: skip
        owners[t], mem[r], count[r] = r, mem[r] + sizes[t] * dim, count[r] + 1
    return owners


def _busiest(owners: list[int], sizes: list[int], world: int) -> float:
    """The busiest rank's larger share over the mean: of the tables' rows or their number."""
    mem, count = [0] * world, [0] * world
    for t, r in enumerate(owners):
        mem[r], count[r] = mem[r] + sizes[t], count[r] + 1
    return max(max(mem) * world / sum(mem), max(count) * world / len(sizes))


@pytest.mark.parametrize("preset", ["tiny", "kaggle", "bench", "terabyte", "dcnv2"])
def test_the_planner_never_loads_its_busiest_rank_more_than_the_sum_of_shares(preset: str):
    """Every preset on 2 to 128 ranks, whole or in column shards: the busiest rank's
    larger share is never above the previous planner's, and below it somewhere."""
    m = get_preset(preset).model
    below = 0
    for world in (2, 3, 4, 6, 8, 12, 16, 32, 64, 128):
        for k in (1, 2, 4, 8):
            sizes, dim = column_shards(m.table_sizes, m.emb_dim, k)
            now = _busiest(plan_tables(sizes, dim, world), sizes, world)
            before = _busiest(_by_sum_of_shares(sizes, dim, world), sizes, world)
            assert now <= before + 1e-9, (world, k, now, before)
            below += now < before - 1e-9
    assert below > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_one_gpu_training_step_never_syncs_the_host() -> None:
    """The trainer's step on one GPU: lookup, the exchange with the hybrid codec both ways
    (the dual policy inside its probe window), MLPs, loss, row-wise Adagrad and SGD
    updates, and no host synchronization anywhere."""
    from recsz.codecs import get_codec
    from recsz.comm import EmbeddingExchange
    from recsz.comm.direction import Direction
    from recsz.comm.stats import ShardPlan
    from recsz.model import DenseArch, RowOptimizer, SparseArch
    from recsz.policy.adaptive import DualBound

    cfg = get_preset("tiny").model
    n = cfg.n_tables
    classes = {"tight": 0.01, "base": 0.03, "loose": 0.05}
    sparse = SparseArch(cfg, range(n), 0, RowOptimizer("rowwise_adagrad", 0.05)).cuda()
    dense = DenseArch(cfg, 0).cuda()
    opt = torch.optim.SGD(dense.parameters(), lr=0.05)

    def direction(name: str) -> Direction:
        return Direction(name, get_codec("hybrid"), DualBound(n, classes, probe_steps=50))

    ex = EmbeddingExchange(ShardPlan([0] * n, 1), 0, direction("fwd"), direction("bwd"))
    sizes = torch.tensor(cfg.table_sizes, device="cuda")

    def step(k: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(k)
        ids = (torch.rand(256, n, device="cuda", generator=g) * sizes).long()
        d = torch.rand(256, cfg.n_dense, device="cuda", generator=g)
        y = (torch.rand(256, device="cuda", generator=g) > 0.5).float()
        emb = ex.start_forward(sparse(ids, checked=True), k, ids)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(dense(d, emb), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    run_without_host_sync(step)
    assert ex.stats.ratio("fwd") > 1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own internals
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_dense_arch_equals_eager_and_waits_outside_the_graph() -> None:
    """--compile: the same logits and gradients as eager, with the embeddings handed over
    as an exchange in flight (whose wait is never traced)."""
    from recsz.model import DenseArch

    cfg = get_preset("tiny").model
    eager, compiled = DenseArch(cfg, 0), DenseArch(cfg, 0)
    # dynamo's graph and AOT autograd as --compile has them; inductor's code generation
    # (torch's own, tested there) left out: it takes half a minute on a CPU
    compiled.compile(backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    d = torch.rand(8, cfg.n_dense, generator=g)
    emb = torch.randn(8, cfg.n_tables, cfg.emb_dim, generator=g)

    class Pending:
        waited, traced = 0, False

        def wait(self) -> torch.Tensor:
            Pending.waited += 1
            Pending.traced |= torch.compiler.is_compiling()
            return emb

    outs = [m(d, Pending()) for m in (eager, compiled)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for o in outs:
        o.sum().backward()
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
    assert Pending.waited == 2 and not Pending.traced


def test_the_trainer_starts_without_torch_compiles_machinery() -> None:
    """torch.compile's dynamo (1.5 s of a process's start here) is not imported with the
    commands' modules, in a process of their own (--compile imports it, as building a
    torch optimizer does: `recsz plan` builds none)."""
    import subprocess
    import sys

    code = (
        "import sys, recsz.cli, recsz.train, recsz.evaluation, recsz.prediction, recsz.step; "
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_bf16_dense_arch_follows_fp32_and_keeps_fp32_state(interaction: str) -> None:
    """--dense-dtype bf16: logits within bfloat16's rounding of float32's and returned as
    float32; the weights, their gradients and the embeddings' gradient (what the exchange
    sends back) stay float32; either interaction."""
    from dataclasses import replace

    from recsz.model import DenseArch

    cfg = replace(get_preset("tiny").model, interaction=interaction)
    ref, amp = DenseArch(cfg, 0), DenseArch(cfg, 0, compute=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    d = torch.rand(64, cfg.n_dense, generator=g)
    emb = torch.randn(64, cfg.n_tables, cfg.emb_dim, generator=g) * 0.1
    outs = []
    for m in (ref, amp):
        e = emb.clone().requires_grad_()
        y = m(d, e)
        y.sum().backward()
        assert y.dtype == e.grad.dtype == torch.float32  # type: ignore[union-attr]
        outs.append((y.detach(), e.grad))
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in amp.parameters())  # type: ignore[union-attr]
    (y32, g32), (y16, g16) = outs
    assert not torch.equal(y32, y16)  # it did compute in bfloat16
    torch.testing.assert_close(y16, y32, rtol=0.03, atol=0.03)
    # bfloat16's own rounding: DCN's rank-512 layers over 432 inputs cost the embeddings'
    # gradient 8.7% here (float32 against float64: 2e-7), the dot products 2.7%
    assert float((g16 - g32).norm() / g32.norm()) < (0.03 if interaction == "dot" else 0.1)


def test_mlp_inits_draw_from_their_distributions_the_same_on_every_rank() -> None:
    """dlrm: N(0, sqrt(2/(fan_in+fan_out))) weights; torch: nn.Linear's uniform in
    +-sqrt(1/fan_in), weights and biases. A seed gives every rank the same start."""
    from recsz.model import DenseArch

    cfg = get_preset("bench").model
    a, b = DenseArch(cfg, 3, init="torch"), DenseArch(cfg, 3, init="torch")
    ref = DenseArch(cfg, 3)
    pairs = zip(a.named_parameters(), b.parameters(), ref.parameters(), strict=True)
    for (name, p), q, r in (((n, p.detach()), q.detach(), r.detach()) for (n, p), q, r in pairs):
        assert torch.equal(p, q), name
        fan_in = p.shape[-1] if p.dim() == 2 else None
        if fan_in is None:  # a bias: its layer's fan_in
            continue
        bound = fan_in**-0.5
        assert float(p.abs().max()) <= bound
        assert abs(float(p.std()) - bound / 3**0.5) < 0.05 * bound, name  # uniform's std
        want = (2.0 / (fan_in + p.shape[0])) ** 0.5
        assert abs(float(r.std()) - want) < 0.05 * want, name
    with pytest.raises(ValueError, match="MLP init 'xavier' is not one of"):
        DenseArch(cfg, 0, init="xavier")


@pytest.mark.parametrize(
    ("interaction", "hotness"),
    [("dot", None), ("dot", (3, 1, 4)), ("dcn", None), ("dcn", (2, 3, 1))],
)
def test_our_dlrm_given_torchrecs_weights_trains_as_torchrecs(
    interaction: str, hotness: tuple[int, ...] | None
) -> None:
    """TorchRec's DLRM (the model its DMP trains) and ours are the same model: from the same
    weights (the interaction's pairs in TorchRec's order, its upper triangle), the same
    logits, and the same losses, weights and logits after steps of SGD on both parts,
    one-hot and multi-hot (the same bags as KJTs). Likewise TorchRec's DLRM_DCN and ours
    with ``interaction="dcn"`` (2 cross layers of rank 3)."""
    pytest.importorskip("fbgemm_gpu")
    torchrec = pytest.importorskip("torchrec")
    from torchrec.models.dlrm import DLRM, DLRM_DCN

    from recsz.model import DenseArch, SparseArch
    from recsz.model.multihot import Bags
    from recsz.model.rowopt import RowOptimizer

    sizes, dim, lr, batch = (40, 25, 60), 4, 0.5, 16
    shape = {"interaction": interaction, "dcn_layers": 2, "dcn_rank": 3}
    cfg = ModelConfig(sizes, dim, bottom_mlp=(8, dim), top_mlp=(6, 1), **shape)  # type: ignore[arg-type]
    hot = hotness or (1,) * len(sizes)
    torch.manual_seed(1)
    configs = [
        torchrec.EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{i}"]
        )
        for i, n in enumerate(sizes)
    ]
    ebc = torchrec.EmbeddingBagCollection(tables=configs)
    mlps = (ebc, 13, list(cfg.bottom_mlp), list(cfg.top_mlp))
    theirs = DLRM(*mlps) if interaction == "dot" else DLRM_DCN(*mlps, 2, 3)
    sparse = SparseArch(cfg, range(3), 0, RowOptimizer("sgd", lr), hotness=hotness)
    dense = DenseArch(cfg, 0, init="torch")
    with torch.no_grad():
        sparse.weight.copy_(torch.cat([ebc.embedding_bags[c.name].weight for c in configs]))
    mlps = [p for name, p in theirs.named_parameters() if "embedding" not in name]
    with pytest.raises(ValueError, match="other shapes"):
        dense.load_torchrec_mlps(mlps[:-1])
    dense.load_torchrec_mlps(mlps)
    start = sparse.weight.detach().clone()
    bags = Bags(range(3), hot, sizes, [0, 0, 0])
    ours_opt = torch.optim.SGD(dense.mlp_parameters(), lr=lr)
    their_opt = torch.optim.SGD(theirs.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    loss = torch.nn.BCEWithLogitsLoss()
    for _ in range(4):
        ids = torch.stack([torch.randint(0, s, (batch,), generator=g) for s in sizes], 1)
        x, y = torch.randn(batch, 13, generator=g), torch.randint(0, 2, (batch,), generator=g)
        kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
            keys=[c.feature_names[0] for c in configs],
            values=torch.cat([b.reshape(-1) for b in bags.ids(ids).split(hot, 1)]),
            lengths=torch.tensor(hot).repeat_interleave(batch),
        )
        mine, their = dense(x, sparse(ids)), theirs(x, kjt).view(-1)
        torch.testing.assert_close(mine, their, rtol=1e-5, atol=1e-5)
        for opt, logits in ((ours_opt, mine), (their_opt, their)):
            opt.zero_grad()
            loss(logits, y.float()).backward()
            opt.step()
    updated = torch.cat([ebc.embedding_bags[c.name].weight for c in configs])
    torch.testing.assert_close(sparse.weight.detach(), updated.detach(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(updated, start)  # the tables did train


@settings(max_examples=40, deadline=None)
@given(
    dim=st.integers(1, 64),
    rows=st.integers(2, 10**7),
    hidden=st.lists(st.integers(1, 512), max_size=3),
    preset=st.sampled_from(["tiny", "bench", "dcnv2"]),
)
def test_the_shape_flags_override_the_presets_model(
    dim: int, rows: int, hidden: list[int], preset: str
) -> None:
    """--emb-dim (the bottom MLP's last width follows it), --bottom-mlp, --top-mlp and
    --max-rows (each table capped) over the preset's model; the rest stays the preset's;
    a shape that does not fit is refused, its flags named."""
    from recsz.config import TrainConfig

    base = get_preset(preset).model
    m = TrainConfig(preset=preset, emb_dim=dim, max_rows=rows).model()
    assert m.emb_dim == dim and m.bottom_mlp == (*base.bottom_mlp[:-1], dim)
    assert m.table_sizes == tuple(min(r, rows) for r in base.table_sizes)
    assert (m.top_mlp, m.interaction, m.dcn_rank) == (base.top_mlp, base.interaction, base.dcn_rank)
    bottom, top = "-".join(map(str, [*hidden, dim])), "-".join(map(str, [*hidden, 1]))
    m = TrainConfig(preset=preset, emb_dim=dim, bottom_mlp=bottom, top_mlp=top).model()
    assert (m.bottom_mlp, m.top_mlp) == ((*hidden, dim), (*hidden, 1))
    with pytest.raises(ValueError, match=r"--emb-dim / --bottom-mlp / --top-mlp: bottom MLP"):
        TrainConfig(preset=preset, emb_dim=dim, bottom_mlp=f"{bottom}-{dim + 1}")
    with pytest.raises(ValueError, match=r"--top-mlp '.*': widths >= 1, dash-separated"):
        TrainConfig(preset=preset, top_mlp=f"{top}-")
