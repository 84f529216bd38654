"""``disagg-bench ...``: the benchmark subcommands.

Who calls it: the ``disagg-bench`` console script (:func:`main`) of the devtools distribution;
``python -m bench.cli`` is the same.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from bench.answers_cmd import add_answers_arguments, answers_command
from bench.binding_cmd import add_bind_arguments, bind_command
from bench.churn_cmd import add_churn_arguments, churn_command
from bench.clients import add_clients_arguments, clients_command
from bench.emulator_accuracy_cmd import (
    add_emulator_accuracy_arguments,
    emulator_accuracy_command,
)
from bench.fleet_binding_cmd import add_fleet_binding_arguments, fleet_binding_command
from bench.fleet_failover_cmd import add_fleet_failover_arguments, fleet_failover_command
from bench.fleet_routing_cmd import add_fleet_routing_arguments, fleet_routing_command
from bench.fleet_scale_cmd import add_fleet_scale_arguments, fleet_scale_command
from bench.overhead_cmd import add_overhead_arguments, overhead_command
from bench.plan_cmd import add_plan_arguments, plan_command
from bench.profile_fit_cmd import add_fit_profile_arguments, fit_profile_command
from bench.routing_cmd import add_routing_arguments, routing_command
from bench.run_cmd import add_run_arguments, run_command
from bench.scenarios_cmd import (
    add_report_arguments,
    add_scenarios_arguments,
    report_command,
    scenarios_command,
)
from bench.soak_cmd import add_soak_arguments, soak_command
from bench.tenants_cmd import add_tenants_arguments, tenants_command
from bench.transfer_cmd import add_transfer_arguments, transfer_command
from bench.vllm_serve_cmd import add_vllm_serve_arguments, vllm_serve_command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmarks' subcommands (``run``, ``overhead``, ``scenarios``, ...) to ``parser``."""
    sub = parser.add_subparsers(dest="bench_command", required=True)
    add_run_arguments(sub.add_parser("run", help="one load-generator run"))
    add_overhead_arguments(
        sub.add_parser("overhead", help="router vs direct latency and max rate on zero-delay fakes")
    )
    add_clients_arguments(
        sub.add_parser("clients", help="upstream HTTP clients: CPU per streamed request")
    )
    add_transfer_arguments(
        sub.add_parser("transfer", help="connector WRITE path vs bare NIXL WRITE, two processes")
    )
    add_scenarios_arguments(
        sub.add_parser("scenarios", help="sweep every stack on real vLLM CPU instances + report")
    )
    add_report_arguments(
        sub.add_parser("report", help="re-render table, plots and summary.json from JSON")
    )
    add_routing_arguments(
        sub.add_parser(
            "routing",
            help="routing policies vs their baselines (fakes + real vLLM CPU) + summary keys",
        )
    )
    add_soak_arguments(
        sub.add_parser("soak", help="bounded soak: concurrent streams, lost/garbled, RSS and fds")
    )
    add_answers_arguments(
        sub.add_parser(
            "answers",
            help="completed answers through push under faults vs an aggregated instance's",
        )
    )
    add_vllm_serve_arguments(
        sub.add_parser(
            "vllm-serve",
            help="vLLM's own `vllm bench serve` against ours, pull and vLLM push (real vLLM CPU)",
        )
    )
    add_bind_arguments(
        sub.add_parser(
            "bind",
            help="push.bind eager vs just_in_time vs adaptive on real vLLM CPU 1P2D + summary keys",
        )
    )
    add_tenants_arguments(
        sub.add_parser(
            "tenants",
            help="noisy neighbour, priority under saturation, token limit on real vLLM CPU 1P1D",
        )
    )
    add_fleet_scale_arguments(
        sub.add_parser(
            "fleet-scale", help="router CPU per request and memory, 1P1D to 32P32D, emulated"
        )
    )
    add_fleet_routing_arguments(
        sub.add_parser(
            "fleet-routing",
            help="KV-aware routing on an emulated fleet: replicas, vllm-router kv_aware",
        )
    )
    add_fleet_binding_arguments(
        sub.add_parser(
            "fleet-binding", help="push.bind eager / just_in_time / adaptive on an emulated fleet"
        )
    )
    add_fleet_failover_arguments(
        sub.add_parser("fleet-failover", help="Ds killed under streamed load on an emulated fleet")
    )
    add_fit_profile_arguments(
        sub.add_parser("fit-profile", help="fit the emulator's cpu-tiny profile to real vLLM CPU")
    )
    add_churn_arguments(
        sub.add_parser("churn", help="an instance joins or leaves every second under load")
    )
    add_plan_arguments(
        sub.add_parser("plan", help="the cheapest xPyD fleet that meets an SLO, emulated")
    )
    add_emulator_accuracy_arguments(
        sub.add_parser(
            "emulator-accuracy", help="the scenario sweep on real vLLM CPU and on the emulator"
        )
    )


def run(args: argparse.Namespace) -> int:
    """Dispatch a parsed ``bench`` namespace; returns the process exit code."""
    command = args.bench_command
    if command == "run":
        return run_command(args)
    if command == "overhead":
        return overhead_command(args)
    if command == "clients":
        return clients_command(args)
    if command == "transfer":
        return transfer_command(args)
    if command == "scenarios":
        return scenarios_command(args)
    if command == "report":
        return report_command(args)
    if command == "routing":
        return routing_command(args)
    if command == "soak":
        return soak_command(args)
    if command == "vllm-serve":
        return vllm_serve_command(args)
    if command == "answers":
        return answers_command(args)
    if command == "bind":
        return bind_command(args)
    if command == "tenants":
        return tenants_command(args)
    if command == "fleet-scale":
        return fleet_scale_command(args)
    if command == "fleet-routing":
        return fleet_routing_command(args)
    if command == "fleet-binding":
        return fleet_binding_command(args)
    if command == "fleet-failover":
        return fleet_failover_command(args)
    if command == "fit-profile":
        return fit_profile_command(args)
    if command == "churn":
        return churn_command(args)
    if command == "emulator-accuracy":
        return emulator_accuracy_command(args)
    if command == "plan":
        return plan_command(args)
    raise ValueError(f"unknown bench command: {command}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg-bench", description="disagg-router benchmarks")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
