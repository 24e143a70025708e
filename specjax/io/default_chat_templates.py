"""The named chat templates a model without its own falls back to (`specjax.io.chat_template`).

A GGUF file with no `tokenizer.chat_template` (the Gemma-3 270M GGUF, a converted base model) gets
one of these, chosen by the turn markers its vocabulary holds and announced once on stderr; any
model can take another template with `--chat-template FILE`. Both are Jinja sources rendered by
the same sandboxed environment as a checkpoint's own template.

  chatml  `<|im_start|>role\\ncontent<|im_end|>\\n` per message, no default system message
  gemma   Gemma 3's template (google/gemma-3-*-it tokenizer_config.json): BOS, `<start_of_turn>`
          turns, `assistant` -> `model`, a system message folded into the first user turn,
          contents trimmed, roles that must alternate
"""

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

DEFAULT_TEMPLATES: dict[str, str] = {"chatml": CHATML, "gemma": GEMMA}

# the turn marker that names each default, looked for in a vocabulary (first match wins)
MARKERS: tuple[tuple[str, str], ...] = (("<start_of_turn>", "gemma"), ("<|im_start|>", "chatml"))
