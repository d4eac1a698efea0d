"""vLLM general plugin: hand each GPU worker's loaded model to LMCache, which CacheBlend needs and never asks for.

LMCache's blender looks the model up with ``VLLMModelTracker.get_model("vllm-instance")`` when the KV connector
starts, but nothing in LMCache (0.5.x) registers it (LMCache issue #4131), so ``vllm serve`` with blending on
fails with "vllm model for vllm-instance not found". vLLM >= 0.11.1 starts the connector in
``Worker.initialize_from_config``, after ``Worker.load_model``; registering at the end of ``load_model`` is
therefore early enough. Older vLLM starts the connector before loading the model and cannot use this plugin.
"""

from __future__ import annotations

import functools


def register() -> None:
    """Wrap ``Worker.load_model`` (once per process) so that it registers the loaded model with LMCache; nothing
    where LMCache is not installed (the plugin stays installed for later plain vLLM runs)."""
    try:
        from lmcache.integration.vllm.utils import ENGINE_NAME
        from lmcache.v1.compute.models.utils import VLLMModelTracker
    except ImportError:
        return
    from vllm.v1.worker.gpu_worker import Worker

    load_model = Worker.load_model
    if getattr(load_model, "registers_with_lmcache", False):
        return

    @functools.wraps(load_model)
    def load_and_register(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        VLLMModelTracker.register_model(ENGINE_NAME, self.model_runner.get_model())
        return result

    load_and_register.registers_with_lmcache = True
    Worker.load_model = load_and_register
