"""Triton Python-based backend `onnx`: serve an ONNX model with ONNX Runtime.

Config parameters (all optional): execution_providers (ordered preference, comma separated, e.g.
CUDA,CPU), execution_provider_options (JSON: provider -> {option: value}, names checked),
disable_cpu_ep_fallback (false: an unusable provider is skipped with a warning; true: it fails the
load), ep_plugin_libraries (JSON: plugin provider name -> library path) (dspark.runtimes.accel.providers);
intra_op_threads (1), inter_op_threads (1), allow_spinning (false), graph_optimization_level
(all|extended|basic|disable) (dspark.triton.params.OnnxParameters); engine
(onnxruntime | tensorrt: a TensorRT engine built from the ONNX file and cached, where TensorRT
and a GPU are present; trt_cache_dir, trt_fp16, trt_max_batch, trt_max_dynamic). See
docs/accelerators.md. The model file is `default_model_filename` or model.onnx in the version folder.
"""
import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from dspark.runtimes.accel.providers import ProviderParameters, ProviderRequest
from dspark.runtimes.accel.tensorrt_engine import TensorRTParameters, open_model_runner
from dspark.runtimes.onnx_session import OnnxRunner, batch_groups, read_graph_signature
from dspark.errors import RequestError
from dspark.params import config_parameters, parse_parameters
from dspark.triton.adapter import stub_version_dir, triton_error
from dspark.triton.metrics import OnnxMetrics
from dspark.triton.params import OnnxParameters
from dspark.tensors import TensorSpec, check_inputs

DEFAULT_FILENAME = "model.onnx"
AUTO_MAX_BATCH_SIZE = 8


def _tensor_config(spec: TensorSpec, batched: bool) -> dict:
    dims = list(spec.dims[1:] if batched else spec.dims)
    return {"name": spec.name, "data_type": spec.data_type, "dims": dims}


def _rows(feeds: dict) -> int:
    return len(next(iter(feeds.values())))


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        """Fill inputs, outputs and batching from the ONNX graph when the config leaves them out."""
        config = auto_complete_model_config.as_dict()
        if config["input"] and config["output"]:
            return auto_complete_model_config
        version_dir = stub_version_dir()
        model_path = version_dir / (config.get("default_model_filename") or DEFAULT_FILENAME) if version_dir else None
        if model_path is None or not model_path.is_file():
            raise pb_utils.TritonModelException(
                f"onnx backend: model '{config['name']}' declares no inputs/outputs and {model_path} "
                "cannot be read to fill them in: add input/output to its config.pbtxt"
            )
        signature = read_graph_signature(model_path)
        batched = config["max_batch_size"] > 0
        if config["max_batch_size"] == 0 and signature.batchable():
            auto_complete_model_config.set_max_batch_size(AUTO_MAX_BATCH_SIZE)
            auto_complete_model_config.set_dynamic_batching()
            batched = True
        if not config["input"]:
            for spec in signature.inputs:
                auto_complete_model_config.add_input(_tensor_config(spec, batched))
        if not config["output"]:
            for spec in signature.outputs:
                auto_complete_model_config.add_output(_tensor_config(spec, batched))
        return auto_complete_model_config

    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        params = parse_parameters(OnnxParameters, self.model_config, ProviderParameters, TensorRTParameters)
        filename = self.model_config.get("default_model_filename") or DEFAULT_FILENAME
        model_path = Path(args["model_repository"]) / args["model_version"] / filename
        if not model_path.is_file():
            raise pb_utils.TritonModelException(
                f"onnx backend: {model_path} does not exist: put the ONNX file there or set default_model_filename"
            )
        self.batched = self.model_config["max_batch_size"] > 0
        self.inputs = [TensorSpec.from_config(entry) for entry in self.model_config["input"]]
        self.output_specs = [TensorSpec.from_config(entry) for entry in self.model_config["output"]]
        raw = config_parameters(self.model_config)
        self.runner = open_model_runner(raw, args["model_name"], args["model_version"], model_path, lambda: (
            OnnxRunner(
                model_path,
                providers=ProviderRequest.from_parameters(raw),
                intra_op_threads=params.intra_op_threads,
                inter_op_threads=params.inter_op_threads,
                allow_spinning=params.allow_spinning,
                graph_optimization_level=params.graph_optimization_level,
            )))
        logger, choice = pb_utils.Logger, self.runner.choice
        if choice.fell_back:
            logger.log_warn(f"onnx backend: {args['model_name']}: runs on {choice.chosen}, not its first preference: "
                            f"{choice.reason}")
        settings = (f"intra_op_threads={self.runner.intra_op_threads}, "
                    f"spinning={'on' if params.allow_spinning else 'off'}"
                    if isinstance(self.runner, OnnxRunner) else self.runner.describe())
        logger.log_info(f"onnx backend: loaded {args['model_name']} version {args['model_version']} from {model_path} "
                        f"on {choice.describe()}, {settings}")
        self.metrics = OnnxMetrics(pb_utils, args["model_name"], args["model_version"], choice)

    def _request_feeds(self, request) -> dict:
        feeds = {}
        for name in [spec.name for spec in self.inputs]:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            feeds[name] = None if tensor is None else tensor.as_numpy()
        check_inputs(self.inputs, feeds, self.batched)
        feeds = {name: array for name, array in feeds.items() if array is not None}
        self.runner.check_feeds(feeds)
        return feeds

    def execute(self, requests):
        responses = [None] * len(requests)
        valid, feeds = [], []
        for index, request in enumerate(requests):
            try:
                feeds.append(self._request_feeds(request))
                valid.append(index)
            except RequestError as error:
                responses[index] = pb_utils.InferenceResponse(error=triton_error(pb_utils, error))
        groups = batch_groups(feeds) if self.batched else [[i] for i in range(len(feeds))]
        for group in groups:
            try:
                results = self.runner.run_batched([feeds[i] for i in group])
            except Exception as error:  # ORT failure on this batch: report it, keep serving
                for i in group:
                    responses[valid[i]] = pb_utils.InferenceResponse(
                        error=triton_error(pb_utils, error, "onnxruntime failed"))
                continue
            self.metrics.batch(sum(_rows(feeds[i]) for i in group) if self.batched else len(group))
            for i, outputs in zip(group, results):
                responses[valid[i]] = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(spec.name, outputs[spec.name]) for spec in self.output_specs]
                )
        return responses

    def finalize(self):
        self.runner = None
