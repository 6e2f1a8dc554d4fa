"""The scalar reader of snapshots between exchanges gives exactly what ``optimizer_scalars`` gives, step after step.

Values and their Python types (``json.dumps`` of both is compared, so 7 and 7.0 differ), for Adam (float32 steps),
an optimizer with plain-number, int64 and bool scalar states, after a key appears in one parameter's state, and
after the structure changes.
"""

from __future__ import annotations

import json

import torch

from tenplex.integration.pieces import named_optimizer_params, optimizer_scalars
from tenplex.integration.snapshot_step import ScalarReader


class Counting(torch.optim.SGD):
    """SGD that keeps scalars of every kind: a Python int, an int64 and a bool tensor, a float64 tensor."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["calls"] = state.get("calls", 0) + 1
                state["count"] = state.get("count", torch.tensor(0, dtype=torch.int64)) + 2
                state["odd"] = torch.tensor(state["calls"] % 2 == 1)
                state["scale"] = torch.tensor(0.5 ** state["calls"], dtype=torch.float64)


def step(model, optimizer, i: int) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.1 * i)
    optimizer.step()


def dumps(found: dict) -> str:
    return json.dumps(found, sort_keys=True)


def test_the_reader_gives_what_optimizer_scalars_gives_at_every_step():
    for make in (lambda ps: torch.optim.Adam(ps, lr=0.1), lambda ps: Counting(ps, lr=0.1, momentum=0.9)):
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        optimizer = make(model.parameters())
        reader, structure = ScalarReader(), object()
        named = named_optimizer_params(model, optimizer)
        for i in range(1, 5):
            step(model, optimizer, i)
            expected = optimizer_scalars(model, optimizer, named)
            assert expected  # every parameter has scalars from the first step on
            assert dumps(reader.read(model, optimizer, named, structure)) == dumps(expected)


def test_a_new_key_or_a_new_structure_walks_again():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    step(model, optimizer, 1)
    reader, structure = ScalarReader(), object()
    named = named_optimizer_params(model, optimizer)
    reader.read(model, optimizer, named, structure)
    optimizer.state[model.bias]["extra"] = 3  # a key the plan does not know
    assert reader.read(model, optimizer, named, structure)["bias"]["extra"] == 3
    optimizer.state[model.bias]["extra"] = 4
    assert reader.read(model, optimizer, named, structure)["bias"]["extra"] == 4  # read from the new plan
    step(model, optimizer, 2)
    other = object()  # the pieces cache's new generation
    assert dumps(reader.read(model, optimizer, named, other)) == dumps(optimizer_scalars(model, optimizer, named))
