"""`dspark trace`: bpftrace over dspark's USDT probes and the sched tracepoints, attached to a
running server, and a report; `--pmu` adds the hardware counters; `--overhead` times the probes."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import click


@click.command()
@click.option("--pid", type=int, help="The tritonserver process (its Python backend stubs are traced with it).")
@click.option("--port", type=int, default=8000, show_default=True,
              help="Without --pid: the server listening on this port.")
@click.option("--duration", type=float, default=10.0, show_default=True,
              help="Seconds to trace; 0: until Ctrl-C.")
@click.option("--pmu", is_flag=True, help="Also read the hardware counters (perf stat) over the same time.")
@click.option("--raw", type=click.Path(dir_okay=False, path_type=Path),
              help="Write bpftrace's own output here too.")
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path),
              help="Also draw the per-token time split and the probe-duration histograms into this PNG.")
@click.option("--overhead", is_flag=True, help="Instead: time the probes' own cost (detached, and attached as root).")
def trace(pid: Optional[int], port: int, duration: float, pmu: bool, raw: Optional[Path], png: Optional[Path],
          overhead: bool) -> None:
    """Trace a running dspark server: per-token time in draft, verify, sampling, streaming and
    waiting; probe duration percentiles; off-CPU time and run-queue latency of its threads; page
    faults and syscalls per request (docs/trace.md)."""
    from dspark.trace import attach, report

    if overhead:
        from dspark.trace.overhead import main
        click.echo(main(200_000, 5, with_tracer=not attach.check()))
        return
    missing = attach.check()
    if missing:
        raise click.ClickException("\n".join(str(m) for m in missing))
    if pid is None:
        pid = attach.server_on_port(port)
        if pid is None:
            raise click.ClickException(f"no process listens on port {port} on this machine: pass --pid or --port")
    pids = attach.server_pids(pid)
    if not pids:
        raise click.ClickException(f"no process {pid}")
    seconds = duration if duration > 0 else None
    click.echo(f"tracing {len(pids)} processes of pid {pid} "
               + (f"for {duration:g} s" if seconds else "until Ctrl-C") + " ...", err=True)
    counters: list[str] = []
    attached = lambda: click.echo("attached", err=True)  # noqa: E731 - the line tests wait for
    if pmu and seconds:
        import threading
        thread = threading.Thread(target=lambda: counters.append(attach.pmu(pid, seconds)[1]), daemon=True)
        out, err, traced = attach.run_bpftrace(attach.program(pids), seconds,
                                               on_start=lambda: (attached(), thread.start()))
        thread.join(seconds + 30)
    else:
        out, err, traced = attach.run_bpftrace(attach.program(pids), seconds, on_start=attached)
        if pmu:
            counters.append(attach.pmu(pid, 1.0)[1])
    if raw:
        raw.write_text(out)
    if traced == 0.0:
        raise click.ClickException("bpftrace did not attach: " + (err.strip().splitlines() or ["no output"])[-1])
    parsed = report.parse(out, traced)
    summary = report.summarize(parsed)
    click.echo(report.format_report(summary, traced))
    if png:
        from dspark.trace.plot import write_png

        try:
            write_png(parsed, summary, png)
        except RuntimeError as error:
            raise click.ClickException(str(error)) from None
        click.echo(f"wrote {png}", err=True)
    for line in counters:
        click.echo(line)
