"""`dspark info`: what this machine and this build can do."""
import platform

import click


@click.command()
def info() -> None:
    """CPU instruction sets (run time and build time), ONNX Runtime providers, the Triton server found."""
    import onnxruntime

    from dspark._ext import cpu_features
    from dspark.server.access import ServerError
    from dspark.server.install import find_server

    features = cpu_features.runtime_features()
    click.echo(f"machine       {platform.machine()}, Python {platform.python_version()}")
    click.echo(f"cpu (run)     {', '.join(name for name, on in features.items() if on and not name.startswith('os_'))}")
    click.echo(f"os saves      {', '.join(name[3:] for name, on in features.items() if on and name.startswith('os_'))}")
    built = cpu_features.build_features()
    click.echo(f"default build {', '.join(name for name, on in built.items() if on) or 'baseline x86-64 (no AVX)'}")
    click.echo(f"usable ISAs   {', '.join(cpu_features.usable_isas())}")
    click.echo(f"onnxruntime   {onnxruntime.__version__}: {', '.join(onnxruntime.get_available_providers())}")
    try:
        install = find_server()
        click.echo(f"tritonserver  {install.binary}")
    except ServerError as error:
        click.echo(f"tritonserver  not found: {error}")
    echo_kernel_info()
    from dspark.cli.accel import echo_accelerator_info
    from dspark.paths import demo_repositories

    echo_accelerator_info(demo_repositories())


def echo_kernel_info() -> None:
    """Lines for `dspark info`: the fused kernel's dispatch, its BLAS, the NUMA topology."""
    from dspark.kernels.dispatch import SIMD_ENV, dispatch_report
    from dspark.kernels.numa import read_topology

    report = dispatch_report()
    click.echo(f"fused kernel  built for {', '.join(report.compiled)}; this CPU+OS runs "
               f"{', '.join(report.supported)}; chosen: {report.chosen}"
               + (f" ({SIMD_ENV}={report.override})" if report.override else " (auto; override with "
                  f"{SIMD_ENV}=scalar|avx2|avx512)"))
    click.echo(f"GEMM          {report.blas}, {report.blas_threads} threads")
    topology = read_topology()
    lines = topology.describe().splitlines()
    click.echo(f"NUMA          {len(topology.nodes)} node(s) from {topology.source}")
    for line in lines:
        click.echo(f"              {line}")
