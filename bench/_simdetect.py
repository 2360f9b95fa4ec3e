"""What each middleware replica learns, on virtual time: snapshots every ``staleness`` seconds,
health checks that take a node out and back, error rates, outlier ejection and slow start. The
rules are the middleware's own (`promptlb.middleware._rules`); only their bookkeeping is the
simulator's."""

from __future__ import annotations

import math
from operator import attrgetter

from promptlb.middleware._nodes import leak_mark
from promptlb.middleware._rules import MIN_RAMP, after_try, eases, ejection_time, faded, ramp
from promptlb.shared import Snapshot

from ._simbase import DETECT, OUTLIER, UNEJECT, SimState
from ._simnode import CRASHED, Node
from ._simreplica import Replica

_TRIM_AT = 1024  # entries every replica has read, dropped in one go

__all__ = ["Detection"]

_FIELDS = Snapshot.__slots__
_values = attrgetter(*_FIELDS)
_new = object.__new__
_set = object.__setattr__


def _renewed(snap: Snapshot) -> Snapshot:
    """An equal snapshot, a new object (`copy.copy` of a frozen slotted class costs 3x this)."""
    out: Snapshot = _new(Snapshot)
    for name, value in zip(_FIELDS, _values(snap), strict=True):
        _set(out, name, value)
    return out


class Detection(SimState):
    def _refresh(self, replica: Replica, now: float) -> None:
        faded_at = replica.faded_at
        # Live, every exchange brings a new snapshot (its own seq), and a learning strategy
        # reads each once (`ServiceModel.see`: the others' trend, the slots): a node's interned
        # one, handed out again while its counts stand still, would be read as no news. So a
        # replica's k-th refresh gets an object made for its k-th (shared by the replicas at
        # their k-th, which refresh once a period like it): never one it was handed before,
        # and a copy a node a period, not one per replica and node (50,000 a second at the
        # largest run). A dead engine sends nothing: its last word stands.
        replica.refreshes = k = replica.refreshes + 1
        marks = replica.marks
        changed = False
        for node, view in zip(self.nodes, replica.views, strict=True):
            snap = node.cur
            if snap is None or now >= node.cur_until:
                snap = node.snapshot(now)
            if node.state != CRASHED:
                if node.issued_from is not snap or node.issued_at != k:
                    node.issued_from, node.issued_at = snap, k
                    node.issued = _renewed(snap)
                snap = node.issued
            view.snapshot = snap
            if node.memory is not None and snap is not None:  # as NodeTable.record_snapshot
                mark = leak_mark(marks[node.idx], snap, OUTLIER.drain_before_oom)
                if mark != marks[node.idx]:
                    marks[node.idx] = mark
                    replica.leaking[node.idx] = mark is not None
                    changed = True
                    if mark is None and replica.alive[node.idx]:
                        self._warm(replica, node.idx, now)  # back from the drain: ramped
            view.in_flight_at_snapshot = view.in_flight
            view.others_since_snapshot = 0
            if view.error_rate:  # as NodeTable.tick fades it, about as often
                view.error_rate = faded(view.error_rate, now - faded_at[node.idx])
                faded_at[node.idx] = now
        if replica.ramping:
            self._ramp(replica, now)
        if changed:
            replica.rebuild()

    def _share(self, r: int) -> None:
        """Replica ``r``'s exchange with the shared store: what it sent since, out; what the
        others wrote since its last read, into its index."""
        replica = self.replicas[r]
        index = replica.strategy.prefix_index
        if index is None:
            return
        shared = self.shared
        records, readings, finishes = index.drain()
        if records or readings or finishes:
            shared.append((r, records, readings, finishes))
        start = self.read_upto[r]
        self.read_upto[r] = len(shared)
        views = {view.name: view for view in replica.views}
        for writer, records, readings, finishes in shared[start:]:
            if writer != r:
                index.take(records, readings, finishes, views)
        # What every replica has read is gone from the store, as the stream's MAXLEN trims it:
        # a long run of many replicas would otherwise hold every record of the run.
        read = min(self.read_upto)
        if read >= _TRIM_AT:
            del shared[:read]
            self.read_upto = [upto - read for upto in self.read_upto]

    def _ramp(self, replica: Replica, now: float) -> None:
        ramping = replica.ramping
        views = replica.views
        slow_start = self.params.slow_start
        for idx, since in list(ramping.items()):
            share = ramp(now - since, slow_start)
            views[idx].ramp = share
            if share >= 1.0:
                del ramping[idx]

    def _warm(self, replica: Replica, idx: int, now: float) -> None:
        """The node just became a candidate again: slow start from `MIN_RAMP` of its share."""
        replica.back_at[idx] = now  # (its `ready_since`, from which ejections ease)
        if self.params.slow_start > 0:
            replica.ramping[idx] = now
            replica.views[idx].ramp = MIN_RAMP

    def _record(self, r: int, idx: int, *, ok: bool, now: float) -> None:
        """A try that ended, for the node's error rate and outlier detection
        (NodeTable.record_result)."""
        replica = self.replicas[r]
        view = replica.views[idx]
        view.error_rate = after_try(faded(view.error_rate, now - replica.faded_at[idx]), ok)
        replica.faded_at[idx] = now
        limit = self.params.outlier_failures
        if ok:
            replica.consecutive[idx] = 0
            times, back = replica.times_ejected[idx], replica.back_at[idx]
            if eases(times, back, replica.eased_at[idx], now, OUTLIER.base_ejection_time):
                replica.times_ejected[idx] -= 1
                replica.eased_at[idx] = now
            return
        if not limit:
            return
        if replica.ejected[idx]:
            # Tries under way when it was ejected, failing now: not a new streak, as
            # NodeTable.record_result has it.
            replica.consecutive[idx] = 0
            return
        replica.consecutive[idx] += 1
        if replica.consecutive[idx] < limit:
            return
        if replica.n_ejected >= self.eject_cap:
            return
        replica.consecutive[idx] = 0
        replica.times_ejected[idx] += 1
        until = now + ejection_time(
            replica.times_ejected[idx], OUTLIER.base_ejection_time, OUTLIER.max_ejection_time
        )
        replica.ejected[idx] = True
        replica.n_ejected += 1
        replica.ejected_until[idx] = until
        replica.ramping.pop(idx, None)
        replica.back_at[idx] = None
        self.ejections += 1
        replica.rebuild()
        self._push(until, UNEJECT, r, idx)

    def _uneject(self, r: int, idx: int, now: float) -> None:
        replica = self.replicas[r]
        if not replica.ejected[idx] or replica.ejected_until[idx] > now:
            return
        replica.ejected[idx] = False
        replica.n_ejected -= 1
        if replica.alive[idx]:
            self._warm(replica, idx, now)
        replica.rebuild()

    def _schedule_detection(self, node: Node, now: float, up: bool) -> None:
        """Each replica's health checks, staggered over the interval, see the change; it counts
        after ``threshold`` checks in a row, unless the node changed back before the last of
        them (`_detect`). Replicas detecting at the same instant share one event, so that a
        fault on many nodes at once costs one rebuild per replica."""
        node.state_since = now
        params = self.params
        interval = params.health_interval
        threshold = params.healthy_threshold if up else params.unhealthy_threshold
        count = len(self.replicas)
        for r in range(count):
            phase = interval * r / count
            first = phase + math.ceil((now - phase) / interval) * interval
            if first < now:  # float rounding
                first += interval
            at = first + (threshold - 1) * interval
            key = (r, at)
            batch = self.detect_at.get(key)
            if batch is None:
                batch = self.detect_at[key] = []
                self._push(at, DETECT, key)
            batch.append((node.idx, up, first))

    def _detect(self, key: tuple[int, float], now: float) -> None:
        replica = self.replicas[key[0]]
        alive = replica.alive
        nodes = self.nodes
        for idx, up, first in self.detect_at.pop(key):
            node = nodes[idx]
            if alive[idx] == up or (node.state != CRASHED) != up or node.state_since > first:
                # Seen already, or the node changed back before the streak's last check: a
                # check the other way reset it (NodeTable.record_health); a change after the
                # first check has its own event.
                continue
            alive[idx] = up
            if up and replica.ejected[idx]:
                # Envoy's successful_active_health_check_uneject_host, as record_health: a
                # node ejected, then unhealthy, that passes its checks again is back.
                replica.ejected[idx] = False
                replica.n_ejected -= 1
                replica.ejected_until[idx] = 0.0
            if up:
                # (record_health's clearing of a leak mark on a node back up applies only to a
                # stale snapshot, which simulated sidecars never have.)
                self._warm(replica, idx, now)
            else:
                replica.ramping.pop(idx, None)
                replica.views[idx].ramp = 1.0
                replica.back_at[idx] = None
        if replica.ramping:
            self._ramp(replica, now)
        replica.rebuild()
