"""Triton Python-based backend `fused_transformer`: a transformer encoder whose MLP blocks
run through the fused LayerNorm+GELU+MatMul kernel, activations from the BFC pool.

The weights file is `default_model_filename` or weights.npz in the version folder.
Config parameters (all optional; dspark.triton.params.FusedTransformerParameters):
threads (BLAS threads, 1), numa_node (pin this instance's threads and its pool's first touch to
that node; unset = no pinning), use_pool (true), pool_bytes (67108864), lock_pages (false: mlock
the pool), huge_pages (true: MADV_HUGEPAGE on the pool).
matmul (fused | gemm): gemm runs every matrix product through the GemmEx shim instead
(dspark.runtimes.accel.gemm_transformer), with gemm_vendor (hcblas | cublas | hipblas | mcblas | mublas),
gemm_device (auto: a GPU through CuPy where one is usable, else the CPU | cpu | cuda) and
gemm_compute (fp32 | bf16).
"""
import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from dspark.runtimes.accel.gemm_transformer import GemmTransformer
from dspark.runtimes.fused_transformer import OUTPUT_NAME, FusedTransformer
from dspark.kernels.dispatch import dispatch_report
from dspark.kernels.pool import PoolError
from dspark.params import parse_parameters
from dspark.triton.adapter import triton_error
from dspark.triton.params import FusedTransformerParameters
from dspark.tensors import TensorSpec, check_inputs


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        params = parse_parameters(FusedTransformerParameters, self.model_config)
        filename = self.model_config.get("default_model_filename") or "weights.npz"
        path = Path(args["model_repository"]) / args["model_version"] / filename
        if not path.is_file():
            raise pb_utils.TritonModelException(
                f"fused_transformer: {path} does not exist: run tools/build_fused_transformer.py "
                "or set default_model_filename")
        if params.matmul == "gemm":
            self.engine = GemmTransformer.load(path, vendor=params.gemm_vendor, device=params.gemm_device,
                                               compute=params.gemm_compute)
            description = f"matrix products through {self.engine.describe()}"
        else:
            try:
                self.engine = FusedTransformer.load(
                    path,
                    threads=params.threads,
                    use_pool=params.use_pool,
                    numa_node=params.numa_node,
                    pool_bytes=params.pool_bytes,
                    lock_pages=params.lock_pages,
                    huge_pages=params.huge_pages,
                )
            except (PoolError, ValueError) as error:
                raise pb_utils.TritonModelException(f"fused_transformer: {args['model_name']}: {error}") from error
            report = dispatch_report()
            numa = "-" if params.numa_node is None else params.numa_node
            description = (f"SIMD {report.chosen}, {report.blas}, pool {'on' if self.engine.pool else 'off'}, "
                           f"numa_node {numa}")
        self.batched = self.model_config["max_batch_size"] > 0
        self.inputs = [TensorSpec.from_config(entry) for entry in self.model_config["input"]]
        pb_utils.Logger.log_info(
            f"fused_transformer: loaded {args['model_name']} from {path}: {self.engine.config}, {description}")
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.metric_families = [pb_utils.MetricFamily(
            name="dspark_fused_pool_bytes_in_use", kind=pb_utils.MetricFamily.GAUGE,
            description="Bytes handed out by the fused transformer's memory pool")]
        self.pool_metric = self.metric_families[0].Metric(labels=labels)

    def _run(self, request):
        tensor = pb_utils.get_input_tensor_by_name(request, self.inputs[0].name)
        ids = None if tensor is None else tensor.as_numpy()
        check_inputs(self.inputs, {self.inputs[0].name: ids}, self.batched)
        hidden = self.engine.forward(ids)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(OUTPUT_NAME, hidden)])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._run(request))
            except Exception as error:  # report it on this request, keep serving
                responses.append(pb_utils.InferenceResponse(
                    error=triton_error(pb_utils, error, "fused_transformer failed")))
        if self.engine.pool is not None:
            self.pool_metric.set(self.engine.pool.stats().bytes_in_use)
        return responses

    def finalize(self):
        self.engine = None
