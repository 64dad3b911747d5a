"""Triton Python-based backend `onnx`: serve an ONNX model with ONNX Runtime.

Config parameters (all optional; dspark.triton.backend_parameters.OnnxParameters):
execution_providers (ordered preference, comma separated, CPUExecutionProvider always last),
intra_op_threads (1), inter_op_threads (1), allow_spinning (false), graph_optimization_level
(all|extended|basic|disable). The model file is `default_model_filename` or model.onnx in the
version folder.
"""
import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from dspark.engines.onnx_session import OnnxRunner, batch_groups, read_graph_signature
from dspark.errors import RequestError
from dspark.triton.adapter import parse_parameters, stub_version_dir, triton_error
from dspark.triton.backend_parameters import OnnxParameters
from dspark.triton.tensors import TensorSpec, check_inputs

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
        params = parse_parameters(OnnxParameters, self.model_config)
        filename = self.model_config.get("default_model_filename") or DEFAULT_FILENAME
        model_path = Path(args["model_repository"]) / args["model_version"] / filename
        if not model_path.is_file():
            raise pb_utils.TritonModelException(
                f"onnx backend: {model_path} does not exist: put the ONNX file there or set default_model_filename"
            )
        self.batched = self.model_config["max_batch_size"] > 0
        self.inputs = [TensorSpec.from_config(entry) for entry in self.model_config["input"]]
        self.output_specs = [TensorSpec.from_config(entry) for entry in self.model_config["output"]]
        self.runner = OnnxRunner(
            model_path,
            providers=params.execution_providers,
            intra_op_threads=params.intra_op_threads,
            inter_op_threads=params.inter_op_threads,
            allow_spinning=params.allow_spinning,
            graph_optimization_level=params.graph_optimization_level,
        )
        logger = pb_utils.Logger
        for provider, reason in self.runner.choice.skipped.items():
            logger.log_warn(f"onnx backend: {args['model_name']}: skipped {provider}: {reason}")
        logger.log_info(
            f"onnx backend: loaded {args['model_name']} version {args['model_version']} from {model_path} "
            f"on {self.runner.choice.chosen}, intra_op_threads={self.runner.session.get_session_options().intra_op_num_threads}, "
            f"spinning={'on' if params.allow_spinning else 'off'}"
        )
        labels = {"model": args["model_name"], "version": args["model_version"]}
        # Families must outlive their metrics, so both are kept on the instance.
        self.metric_families = [
            pb_utils.MetricFamily(name="dspark_onnx_batches_total", kind=pb_utils.MetricFamily.COUNTER,
                                  description="ONNX Runtime runs (one per batch of requests)"),
            pb_utils.MetricFamily(name="dspark_onnx_batch_rows_total", kind=pb_utils.MetricFamily.COUNTER,
                                  description="Rows run through ONNX Runtime; divided by runs it is the mean batch"),
        ]
        self.batches_metric, self.rows_metric = (family.Metric(labels=labels) for family in self.metric_families)

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
            self.batches_metric.increment(1)
            self.rows_metric.increment(sum(_rows(feeds[i]) for i in group) if self.batched else len(group))
            for i, outputs in zip(group, results):
                responses[valid[i]] = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(spec.name, outputs[spec.name]) for spec in self.output_specs]
                )
        return responses

    def finalize(self):
        self.runner = None
