"""One line of proof for tools/test_matrix.sh: the precision the CPU plugin compiles with under
$OVROUTER_OV_CONFIG (as the model servers merge it), next to the ISA oneDNN reports (ONEDNN_VERBOSE)."""

import json
import os

import numpy as np
import openvino as ov
import openvino.opset13 as ops

properties = json.loads(os.environ.get("OVROUTER_OV_CONFIG") or "{}")
x = ops.parameter([4, 64], np.float32)
model = ov.Model([ops.matmul(x, ops.constant(np.ones((64, 64), np.float32)), False, False)], [x])
compiled = ov.Core().compile_model(model, "CPU", properties)
compiled.create_infer_request().infer({0: np.ones((4, 64), np.float32)})
print("compiled INFERENCE_PRECISION_HINT:", compiled.get_property("INFERENCE_PRECISION_HINT"))
