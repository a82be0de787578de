"""A run's health as Ray metrics (ray.util.metrics), so it shows in the Prometheus and Grafana
that already watch the Ray cluster. Ray prefixes each name with `ray_`; every series has the
tag `run` (the run directory's name). Recorded on the driver from the rows and events the
run writes (a Callback); Ray's metrics agent on the driver's node exports them.

  stalwart_failures_total{kind}       failures by kind (worker_died, hang, node_died, ...)
  stalwart_recoveries_total{source}   recoveries by where the state came from (memory, storage)
  stalwart_recovery_seconds           histogram: from a failure to the first step after it
  stalwart_lost_steps_total           steps trained again after recoveries
  stalwart_resizes_total              world resizes
  stalwart_numerical_faults_total{fault,action}   numerical faults, by fault and decision
  stalwart_step                       the last logged step
  stalwart_world_size                 ranks in the current world
  stalwart_tokens_per_second          tokens/s of the last metrics row
  stalwart_goodput                    productive step time / wall time so far (as `stalwart
                                      report` computes it), updated at most every 10 s
"""

from __future__ import annotations

import time
from typing import Any

from stalwart.core import events as ev
from stalwart.core.events import Event, MetricsRow
from stalwart.integrations.loggers import Tracker

RECOVERY_BOUNDARIES = [0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]
GOODPUT_EVERY_S = 10.0


class RayMetrics(Tracker):
    name = "ray_metrics"

    def __init__(self, run: str) -> None:
        """Needs a connected Ray (the metrics register with it); `run` tags every series."""
        from ray.util.metrics import Counter, Gauge, Histogram

        self.tags = {"run": run}
        keys = ("run",)
        self.failures = Counter("stalwart_failures_total", tag_keys=(*keys, "kind"),
                                description="Failures of the run, by kind.")
        self.recoveries = Counter("stalwart_recoveries_total", tag_keys=(*keys, "source"),
                                  description="Recoveries, by where the state came from.")
        self.recovery_s = Histogram("stalwart_recovery_seconds", tag_keys=keys,
                                    boundaries=RECOVERY_BOUNDARIES,
                                    description="Seconds from a failure to the next step.")
        self.lost_steps = Counter("stalwart_lost_steps_total", tag_keys=keys,
                                  description="Steps trained again after recoveries.")
        self.resizes = Counter("stalwart_resizes_total", tag_keys=keys,
                               description="World resizes.")
        self.numerical = Counter("stalwart_numerical_faults_total",
                                 tag_keys=(*keys, "fault", "action"),
                                 description="Numerical faults, by fault and decision.")
        self.step = Gauge("stalwart_step", tag_keys=keys, description="The last logged step.")
        self.world_size = Gauge("stalwart_world_size", tag_keys=keys,
                                description="Ranks in the current world.")
        self.tokens_per_s = Gauge("stalwart_tokens_per_second", tag_keys=keys,
                                  description="Tokens per second of the last metrics row.")
        self.goodput = Gauge("stalwart_goodput", tag_keys=keys,
                             description="Productive step time / wall time so far.")
        self._events: list[Event] = []
        self._rows: list[MetricsRow] = []
        self._goodput_at = 0.0

    def on_event(self, event: Event) -> None:
        self._events.append(event)
        if isinstance(event, ev.Failure):
            self.failures.inc(1, tags={**self.tags, "kind": event.failure_kind})
        elif isinstance(event, ev.Recovered):
            self.recoveries.inc(1, tags={**self.tags, "source": event.source})
            self.recovery_s.observe(event.recovery_s, tags=self.tags)
            if event.lost_steps > 0:
                self.lost_steps.inc(event.lost_steps, tags=self.tags)
            self.world_size.set(event.world_size, tags=self.tags)
        elif isinstance(event, ev.Resized):
            self.resizes.inc(1, tags=self.tags)
            self.world_size.set(event.new_world_size, tags=self.tags)
        elif isinstance(event, ev.NumericalFault):
            self.numerical.inc(1, tags={**self.tags, "fault": event.fault,
                                        "action": event.action})
        elif isinstance(event, ev.Started):
            self.world_size.set(event.world_size, tags=self.tags)

    def on_metrics(self, row: MetricsRow) -> None:
        self._rows.append(row)
        self.step.set(row.step, tags=self.tags)
        self.world_size.set(row.world_size, tags=self.tags)
        self.tokens_per_s.set(row.tokens_per_s, tags=self.tags)
        if time.time() - self._goodput_at >= GOODPUT_EVERY_S:
            self._update_goodput()

    def on_end(self, result: Any) -> None:
        self._update_goodput()

    def _update_goodput(self) -> None:
        from stalwart.report.summary import summarize

        self._goodput_at = time.time()
        if not self._events:
            return
        goodput = summarize(self._events, self._rows, now=self._goodput_at).goodput
        if goodput is not None:
            self.goodput.set(goodput, tags=self.tags)
