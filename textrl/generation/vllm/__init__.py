"""textrl's vLLM engines, one module a concern (imported on use: ``import textrl`` loads none of them).

The ``vllm`` engine, vLLM in this process (:mod:`~textrl.generation.vllm.colocated`), builds on:

- ``checks``: vLLM installed and importing, a policy it can run;
- ``handover``: the weights vLLM takes (a LoRA policy's base, or merged), the model folder it starts
  on, a bucket loaded in its worker;
- ``options``: vLLM's options from the run's config, the model length, the CPU's KV cache, sleep;
- ``launch``: the training processes it starts among (torchrun, accelerate launch);
- ``sampling``: what a request asks and the rows it hands back (shared with the served engine).

The ``vllm-server`` engine, vLLM servers elsewhere (:mod:`~textrl.generation.vllm.served`), builds on:

- ``budgets``: its timeouts, retries, health checks and leases, read at call time;
- ``transport``: one HTTP exchange, its failures in a few words, the errors that name the server;
- ``server``: one server, its requests with their retries, its checks before any work, its claim;
- ``claims``: one run per server, and every server checked and claimed before any work;
- ``dealing``: what a call asks, dealt over the servers, dealt again when one fails;
- ``push``: the weights pushed to the servers and checked there;
- ``serve_command``: ``textrl vllm-serve``, vLLM's server with what textrl needs.

``textrl.generation.vllm_engine`` and ``textrl.generation.vllm_server`` name these modules' public
names as they did before the split. vLLM's side of the weight transfer stays in
:mod:`textrl.generation.vllm_transfer` (the plugin vLLM loads by that name) and
:mod:`textrl.generation.vllm_worker`.
"""
