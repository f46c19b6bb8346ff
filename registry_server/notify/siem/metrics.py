"""The SIEM export's Prometheus metrics, read from the exporters when
scraped. Labelled by the kind of destination (jsonl, syslog: at most one of
each), never by a path or an address."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from registry_server.notify.siem.exporter import Exporter


class ExportMetrics(Collector):
    def __init__(self, exporters: Sequence[Exporter]) -> None:
        self._exporters = tuple(exporters)

    def collect(self) -> Iterator[Metric]:
        lag = GaugeMetricFamily(
            "toolreg_siem_export_lag_records",
            "Audit records the SIEM destination has not confirmed yet", labels=["sink"],
        )  # fmt: skip
        lag_s = GaugeMetricFamily(
            "toolreg_siem_export_lag_seconds",
            "Age of the oldest audit record the SIEM destination has not confirmed (0: none)",
            labels=["sink"],
        )  # fmt: skip
        confirmed = GaugeMetricFamily(
            "toolreg_siem_export_confirmed_seq",
            "The last audit record the SIEM destination confirmed", labels=["sink"],
        )  # fmt: skip
        active = GaugeMetricFamily(
            "toolreg_siem_export_active",
            "1 when this server holds the destination's lease (exports to it)", labels=["sink"],
        )  # fmt: skip
        exported = CounterMetricFamily(
            "toolreg_siem_exported_events", "OCSF events this server delivered", labels=["sink"]
        )
        failures = CounterMetricFamily(
            "toolreg_siem_export_failures", "Failed attempts to deliver a batch", labels=["sink"]
        )
        for e in self._exporters:
            label = [e.sink.label]
            lag.add_metric(label, e.lag_records)
            lag_s.add_metric(label, e.lag_seconds)
            confirmed.add_metric(label, e.cursor)
            active.add_metric(label, 1 if e.holds else 0)
            exported.add_metric(label, e.exported)
            failures.add_metric(label, e.failures)
        yield from (lag, lag_s, confirmed, active, exported, failures)
