"""The pairwise reduction gives bit-identical training for every data-parallel degree D."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from stalwart.parallel.invariant_reduce import PairwiseAccumulator, tree_sum_
from tests.dist.launcher import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

G = 8  # micro-batches per global batch
MICRO = 4  # samples per micro-batch
STEPS = 5


class Net(nn.Module):
    """Two Linears and a tanh, plus a `gate` used by micro-batch 0 only (so at D >= 2 some
    ranks have no gradient for it) and an `unused` parameter that never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.gate = nn.Parameter(torch.randn(4))
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor, micro_batch: int) -> torch.Tensor:
        y = self.fc2(torch.tanh(self.fc1(x)))
        return y * self.gate if micro_batch == 0 else y


def micro_batch(step: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + i)
    # Mixed magnitudes make the summation order visible in the low bits.
    x = torch.randn(MICRO, 16, generator=gen) * (1 + 10 * torch.rand(MICRO, 1, generator=gen))
    return x, torch.randn(MICRO, 4, generator=gen)


def train(rank: int, world: int, pairwise: bool) -> dict[str, torch.Tensor]:
    """STEPS AdamW steps on rank's contiguous share of the G micro-batches of each batch."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    acc = PairwiseAccumulator(model.parameters())
    group = dist.group.WORLD if world > 1 else None
    k = G // world
    for step in range(STEPS):
        for i in range(rank * k, rank * k + k):
            x, y = micro_batch(step, i)
            (nn.functional.mse_loss(model(x, i), y) / G).backward()
            if pairwise:
                acc.add()
        if pairwise:
            acc.reduce_into_grads(group)
        else:  # the usual DDP way: local running sum, then all_reduce
            for p in model.parameters():
                if p.grad is None:  # zeros at every D alike, so only rounding can differ
                    p.grad = torch.zeros_like(p)
                if world > 1:
                    dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if pairwise:
        assert model.unused.grad is None
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def train_both(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    return {"pairwise": train(rank, world, True), "plain": train(rank, world, False)}


@pytest.fixture(scope="module")
def final_params() -> dict[int, list[dict[str, dict[str, torch.Tensor]]]]:
    return {world: run_ranks(train_both, world) for world in (1, 2, 4)}


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in a if not torch.equal(a[name], b[name])]


def test_pairwise_is_bitwise_identical_across_degrees(final_params) -> None:
    reference = final_params[1][0]["pairwise"]
    for world in (2, 4):
        for rank, result in enumerate(final_params[world]):
            assert differing(reference, result["pairwise"]) == [], (world, rank)
    # The never-used parameter was never touched (grad None: AdamW skips it, no decay).
    torch.manual_seed(0)
    assert torch.equal(reference["unused"], Net().unused)


def test_plain_all_reduce_is_not_bitwise_identical(final_params) -> None:
    """The control: the usual reduction does change bits with D, so the test above can fail."""
    plain1, plain4 = final_params[1][0]["plain"], final_params[4][0]["plain"]
    assert differing(plain1, plain4) != []
    # Still the same training up to rounding.
    for name in plain1:
        torch.testing.assert_close(plain1[name], plain4[name])


def reference_tree(xs: list[torch.Tensor]) -> torch.Tensor:
    """The canonical tree, out of place: halves for a power of two, else split at the largest
    power of two below len(xs)."""
    n = len(xs)
    if n == 1:
        return xs[0]
    half = n // 2 if n & (n - 1) == 0 else 1 << (n.bit_length() - 1)
    return reference_tree(xs[:half]) + reference_tree(xs[half:])


def accumulate(params: list[nn.Parameter], leaves: list[list[torch.Tensor]]
               ) -> list[torch.Tensor | None]:
    acc = PairwiseAccumulator(params)
    for leaf in leaves:
        for p, g in zip(params, leaf, strict=True):
            p.grad = g.clone()
        acc.add()
        assert all(p.grad is None for p in params)
    return acc.local_sum()


@pytest.mark.unit
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7, 8, 12])
def test_stack_merge_is_the_canonical_tree(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    params = [nn.Parameter(torch.zeros(257)), nn.Parameter(torch.zeros(3, 5))]
    leaves = [[torch.randn(p.shape, generator=gen) * 10 ** torch.randint(-3, 4, p.shape,
                                                                         generator=gen)
               for p in params] for _ in range(k)]
    total = accumulate(params, leaves)
    for j, got in enumerate(total):
        assert torch.equal(got, reference_tree([leaf[j] for leaf in leaves]))
    if k == 8:  # the order matters for this data, so the comparison above has teeth
        sequential = leaves[0][0].clone()
        for leaf in leaves[1:]:
            sequential += leaf[0]
        assert not torch.equal(total[0], sequential)


@pytest.mark.unit
@pytest.mark.parametrize(("n", "degrees"), [(8, [1, 2, 4, 8]), (12, [1, 3, 6, 12])])
def test_ranks_tree_equals_global_tree_when_k_is_a_power_of_two(n: int, degrees: list[int]
                                                                ) -> None:
    """What reduce_into_grads does after the gather (tree over per-rank sums), in process."""
    gen = torch.Generator().manual_seed(n)
    param = nn.Parameter(torch.zeros(1000))
    leaves = [[torch.randn(1000, generator=gen) * 10 ** torch.randint(-3, 4, (1000,),
                                                                      generator=gen)]
              for _ in range(n)]
    expected = reference_tree([leaf[0] for leaf in leaves])
    for d in degrees:
        k = n // d
        per_rank = [accumulate([param], leaves[r * k:r * k + k])[0] for r in range(d)]
        assert torch.equal(tree_sum_(per_rank), expected), d
