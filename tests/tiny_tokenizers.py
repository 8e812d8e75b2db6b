"""Tiny Hugging Face tokenizer folders, trained in milliseconds, for tests.

`save_tiny_tokenizer(path, style)` writes tokenizer.json + tokenizer_config.json (+ a
special_tokens_map.json) that `transformers.AutoTokenizer` and `ferry.tokenizer.Tokenizer` both load.
Every style stays under 512 ids, so a tiny model with vocab_size 512 can use it.

Styles:
  "bytelevel"      Qwen-like: NFC + split regex + byte-level BPE, no BOS, ChatML template with tools.
  "bytelevel_bos"  Llama-3-like: byte-level BPE whose post-processor adds <|begin_of_text|>,
                   a header-style template that reads `strftime_now` and uses loop controls.
  "sentencepiece"  Llama-2-like: Metaspace + BPE with byte fallback (<0x00>..<0xFF>), a
                   TemplateProcessing post-processor adding <s>, and the [INST] template that
                   raises on a bad role order.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

STYLES = ("bytelevel", "bytelevel_bos", "sentencepiece")

# Training text: English prose, code, emoji (with ZWJ and variation selectors), CJK, combining
# marks and accented Latin, so that merges exist for all of them and some characters stay split
# across several byte-level tokens.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?",
    "Once upon a time, there was a small engine that served language models very fast.",
    "The assistant answers questions about the weather, the time and the capital of France.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n",
    "class Request:\n    def __init__(self, prompt: str) -> None:\n        self.prompt = prompt\n",
    'if (x != nullptr) { return {"key": [1, 2, 3]}; }  // C++ and JSON {"a": true}',
    "Emoji: 😀 😃 🎉 🚀 👍🏽 👨‍👩‍👧 ❤️ 🇫🇷 — and more 😀🎉🚀 in a row.",
    "中文：你好，世界！我很感谢你的热情。今天天气很好。日本語：こんにちは世界。한국어: 안녕하세요",
    "Accents and combining marks: café naïve résumé e\u0301 a\u0308 n\u0303 Ångström Øre.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 3.14159 2024-05-01 12:30:45 $100 50% #tag @user",
    "Newlines\n\nand\ttabs\r\n and    multiple   spaces at the end   ",
] * 3

_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n' }}\n"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}\n"
    "{{- '# Tools\\n<tools>' }}\n"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}\n"
    "{{- '\\n</tools><|im_end|>\\n' }}\n"
    "{%- elif messages[0].role == 'system' %}\n"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'system' %}{%- continue %}{%- endif %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' }}\n"
    "{%- if message.content is string %}{{- message.content }}\n"
    "{%- else %}{%- for part in message.content %}{{- part.text }}{%- endfor %}{%- endif %}\n"
    "{%- if message.tool_calls is defined %}\n"
    "{%- for call in message.tool_calls %}\n"
    "{{- '\\n<tool_call>\\n' + (call.function | tojson) + '\\n</tool_call>' }}\n"
    "{%- endfor %}\n"
    "{%- endif %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if date_string is not defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}\n"
    "{%- set ns = namespace(system='', seen_user=false) %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'system' %}{%- set ns.system = message.content %}{%- break %}{%- endif %}\n"
    "{%- endfor %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: ' + date_string + '\\n\\n' }}\n"
    "{{- ns.system | trim }}{{- '<|eot_id|>' }}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role == 'system' %}{%- continue %}{%- endif %}\n"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)

# Characters the SentencePiece-like style learns pieces for; everything else is byte fallback.
_SP_ALPHABET = frozenset(chr(c) for c in range(32, 127)) | set("\n▁éèàïçñöüÅØ")

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)


def save_tiny_tokenizer(path: str | Path, style: str = "bytelevel") -> Path:
    """Write a tiny tokenizer folder of the given style into `path` (created if needed); returns it."""
    builders = {"bytelevel": _qwen_like, "bytelevel_bos": _llama3_like, "sentencepiece": _llama2_like}
    if style not in builders:
        raise ValueError(f"unknown tokenizer style {style!r}; choose one of {STYLES}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, config = builders[style]()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    named = {k: v["content"] if isinstance(v, dict) else v for k, v in config.items() if k.endswith("_token") and v}
    (path / "special_tokens_map.json").write_text(json.dumps(named, indent=2, ensure_ascii=False))
    return path


def _train_byte_level(special_tokens: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=special_tokens,
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def _qwen_like() -> tuple[Tokenizer, dict]:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = _train_byte_level(specials, vocab_size=500)
    tokenizer.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "chat_template": CHATML_TEMPLATE,
    }
    return tokenizer, config


def _llama3_like() -> tuple[Tokenizer, dict]:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokenizer = _train_byte_level(specials, vocab_size=500)
    tokenizer.normalizer = None
    bos = "<|begin_of_text|>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, tokenizer.token_to_id(bos))],
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": "<|eot_id|>",
        "model_max_length": 131072,
        # A list of named templates, as some models ship them; "default" is the one used.
        "chat_template": [{"name": "default", "template": LLAMA3_TEMPLATE}],
    }
    return tokenizer, config


def _llama2_like() -> tuple[Tokenizer, dict]:
    # Train merges on Metaspace words with a small alphabet, then rebuild the vocabulary in
    # Llama-2's layout: <unk> <s> </s>, the 256 byte tokens, then the learned pieces. Characters
    # outside the alphabet (CJK, emoji) are spelled with byte tokens, as in Llama-2.
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # Split at spaces while training, so that merges stay inside words, as SentencePiece's do.
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=250, initial_alphabet=sorted(_SP_ALPHABET), special_tokens=[], show_progress=False
    )
    trainer_tok.train_from_iterator(["".join(c for c in line if c in _SP_ALPHABET) for line in CORPUS], trainer)
    learned = json.loads(trainer_tok.to_str())["model"]
    pieces = sorted(learned["vocab"], key=learned["vocab"].get)
    layout = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    vocab = {piece: i for i, piece in enumerate(layout)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.pre_tokenizer = metaspace
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False},
        "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False},
        "unk_token": "<unk>",
        "pad_token": None,
        "legacy": False,
        "model_max_length": 4096,
        "chat_template": LLAMA2_TEMPLATE,
    }
    return tokenizer, config
