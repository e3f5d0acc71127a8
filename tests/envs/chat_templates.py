"""Chat templates of two families, written for the tests, as the tiny tokenizer can render them.

Both are ChatML (``<|im_start|>role\\n...<|im_end|>\\n``, the tiny tokenizer's specials) with a
default system turn and ``tool`` messages wrapped in a ``user`` turn, as Qwen's are:

- :data:`QWEN25_STYLE` renders every message as it is (append-only): a multi-turn episode's context
  is what it renders.
- :data:`QWEN3_STYLE` renders an assistant turn at or before the last real user message without
  its ``<think>...</think>`` block, and the assistant turns after it (the current tool-calling
  exchange) with theirs; the last assistant turn gets an empty ``<think>`` block when it has none
  (Qwen3's history handling). Not append-only.
- :data:`LLAMA3_STYLE` is Llama 3's layout (a header line per message, contents trimmed, BOS
  first), with the tiny tokenizer's ``<|im_end|>`` as its end of turn. Append-only for contents
  without leading or trailing whitespace.
- :data:`STRIP_THINK` only drops ``<think>`` blocks from assistant turns that are not the last
  message (the template the issue was found with).
"""

SYSTEM = "{%- if messages[0]['role'] != 'system' -%}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}{%- endif -%}"

_TOOL = (
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
)
_PROMPT = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"

QWEN25_STYLE = (
    SYSTEM
    + "{%- for m in messages -%}"
    "{%- if m['role'] in ('system', 'user', 'assistant') -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    + _TOOL
    + "{%- endif -%}{%- endfor -%}"
    + _PROMPT
)

QWEN3_STYLE = (
    SYSTEM
    + "{%- set ns = namespace(last_query=messages|length - 1, tools=true) -%}"
    "{%- for m in messages[::-1] -%}"
    "{%- if ns.tools and m['role'] == 'user' and not m['content'].startswith('<tool_response>') -%}"
    "{%- set ns.tools = false -%}{%- set ns.last_query = messages|length - 1 - loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' or m['role'] == 'system' -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] -%}{%- set thought = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set thought = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or thought) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + thought + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    + _TOOL
    + "{%- endif -%}{%- endfor -%}"
    + _PROMPT
)

LLAMA3_STYLE = (
    "{%- for m in messages -%}"
    "{%- set c = '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|im_end|>' -%}"
    "{%- if loop.index0 == 0 -%}{%- set c = bos_token + c -%}{%- endif -%}{{- c -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

STRIP_THINK = (
    SYSTEM
    + "{%- for m in messages -%}{%- set c = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and not loop.last -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' -}}{%- endfor -%}"
    + _PROMPT
)


def with_template(tokenizer, template: str):
    """A copy of ``tokenizer`` with chat template ``template``."""
    import copy

    copied = copy.deepcopy(tokenizer)
    copied.chat_template = template
    return copied
