"""A task checks its own [task.args] when build_task constructs it on the driver.

GPTTask checks every argument (type, range, how they combine, unknown keys); any task gets
unknown keys refused from its constructor's signature.
"""

from __future__ import annotations

import math

import pytest

from stalwart.core.errors import TaskError
from stalwart.core.task import TrainTask, build_task, check_arg_names

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

GPT = "stalwart.examples.gpt.task:GPTTask"


@pytest.mark.parametrize(("args", "message"), [
    ({"val_fraction": 5}, "task.args.val_fraction = 5 is invalid: must be a number between 0 "
                          "and 1 (exclusive)"),
    ({"val_fraction": 0}, "task.args.val_fraction = 0 is invalid"),
    ({"val_fraction": 1.0}, "task.args.val_fraction = 1.0 is invalid"),
    ({"val_fraction": -0.5}, "task.args.val_fraction = -0.5 is invalid"),
    ({"val_fraction": "0.1"}, "task.args.val_fraction = '0.1' is invalid"),
    ({"val_fraction": True}, "task.args.val_fraction = True is invalid"),
    ({"val_fraction": math.nan}, "task.args.val_fraction = nan is invalid"),
    ({"val_fraction": math.inf}, "task.args.val_fraction = inf is invalid"),
    ({"val_fraction": 1e-6}, "task.args.val_fraction = 1e-06 is invalid: it puts 0 of "),
    ({"val_fraction": 0.999999}, "task.args.val_fraction = 0.999999 is invalid: it puts "),
    ({"vocab_size": 100}, "task.args.vocab_size = 100 is invalid: must be >= 256 (the tokens "
                          "are bytes)"),
    ({"vocab_size": "256"}, "task.args.vocab_size = '256' is invalid: must be an int >= 1"),
    ({"vocab_size": 256.0}, "task.args.vocab_size = 256.0 is invalid: must be an int >= 1"),
    ({"d_model": 0}, "task.args.d_model = 0 is invalid: must be an int >= 1"),
    ({"d_model": True}, "task.args.d_model = True is invalid: must be an int >= 1"),
    ({"seq_len": -1}, "task.args.seq_len = -1 is invalid"),
    ({"n_layers": 1.5}, "task.args.n_layers = 1.5 is invalid"),
    ({"d_model": 64, "n_heads": 3}, "task.args.n_heads = 3 is invalid: must divide "
                                    "d_model = 64"),
    ({"d_model": 32, "n_heads": 32}, "task.args.n_heads = 32 is invalid: must make head_dim "
                                     "= d_model / n_heads even (it is 1)"),
    ({"ffn_hidden": -1}, "task.args.ffn_hidden = -1 is invalid: must be an int >= 0"),
    ({"ffn_hidden": True}, "task.args.ffn_hidden = True is invalid"),
    ({"rope_theta": math.inf}, "task.args.rope_theta = inf is invalid: must be a finite "
                               "number > 0"),
    ({"norm_eps": math.nan}, "task.args.norm_eps = nan is invalid: must be a finite number"),
    ({"init_std": 0.0}, "task.args.init_std = 0.0 is invalid"),
    ({"init_std": "0.02"}, "task.args.init_std = '0.02' is invalid"),
    ({"tie_embeddings": "no"}, "task.args.tie_embeddings = 'no' is invalid: must be true or "
                               "false"),
    ({"tie_embeddings": 1}, "task.args.tie_embeddings = 1 is invalid"),
    ({"dmodel": 64}, "unknown key task.args.dmodel; allowed: val_fraction, d_model, "),
])
def test_gpt_task_refuses_each_bad_argument_by_its_key(args, message) -> None:
    with pytest.raises(TaskError) as err:
        build_task(GPT, args)
    assert str(err.value).startswith(message), str(err.value)


def test_gpt_task_takes_good_arguments() -> None:
    task = build_task(GPT, {"val_fraction": 0.1, "d_model": 64, "n_heads": 2, "rope_theta": 500,
                            "tie_embeddings": False})
    assert task.val_fraction == 0.1 and task.model_config.d_model == 64
    assert not task.model_config.tie_embeddings


class Plain(TrainTask):
    def __init__(self, *, width: int = 8, depth: int = 2) -> None:
        self.width, self.depth = width, depth


class Open(TrainTask):
    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs


def test_any_task_gets_unknown_keys_refused_before_its_constructor_runs() -> None:
    with pytest.raises(TaskError, match=r"^unknown key task\.args\.widht for Plain; allowed: "
                                        r"width, depth$"):
        check_arg_names(Plain, {"widht": 3})
    check_arg_names(Plain, {"width": 3})
    check_arg_names(Open, {"anything": 1})  # **kwargs: the task checks its own
