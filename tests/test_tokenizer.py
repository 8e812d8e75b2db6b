"""ferry's Tokenizer against Hugging Face transformers on the tiny tokenizer folders."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ferry.tokenizer import Tokenizer
from tiny_tokenizers import STYLES, save_tiny_tokenizer

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

STRINGS = [
    "",
    " ",
    "Hello world!",
    " leading and trailing spaces  ",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    'if (x != nullptr) { return {"key": [1, 2, 3]}; }',
    "Emoji 😀🎉🚀 👍🏽 👨‍👩‍👧 ❤️ 🇫🇷 🦀 and 🧪",
    "中文：你好，世界！日本語：こんにちは。한국어: 안녕하세요",
    "combining: e\u0301 a\u0308 n\u0303 and precomposed é ä ñ",
    "tabs\tand\nnewlines\r\n\n\nand    runs   of spaces",
    "numbers 3.14159 2024-05-01 $100 50%",
    "<|im_start|>user\nhi<|im_end|>",
    "<s>[INST] hi [/INST] ok </s>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>",
    "<tool_call>{}</tool_call>",
    "\u200b zero width \ufeff bom \x00 nul",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hello 😀"},
        {"role": "assistant", "content": "Hi! 你好"},
        {"role": "user", "content": "  Write code:\ndef f(): pass  "},
    ],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Two"},
        {"role": "user", "content": "Three"},
        {"role": "assistant", "content": "Four"},
    ],
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather at a place <and> time, in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {style: save_tiny_tokenizer(tmp_path_factory.mktemp(style), style) for style in STYLES}


@pytest.fixture(scope="module")
def pairs(folders: dict[str, Path]) -> dict[str, tuple[Tokenizer, object]]:
    auto = transformers.AutoTokenizer
    return {style: (Tokenizer.from_pretrained(path), auto.from_pretrained(path)) for style, path in folders.items()}


def _copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for path in src.iterdir():
        (dst / path.name).write_bytes(path.read_bytes())
    return dst


# ---- encode / decode ----


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pairs, style: str, add_special_tokens: bool) -> None:
    ours, theirs = pairs[style]
    for text in STRINGS:
        expected = theirs.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(pairs, style: str, skip_special_tokens: bool) -> None:
    ours, theirs = pairs[style]
    for text in STRINGS:
        ids = theirs.encode(text)
        expected = theirs.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == expected, text


def test_bos_comes_from_the_post_processor(pairs) -> None:
    sp, _ = pairs["sentencepiece"]
    assert sp.encode("hi")[0] == sp.bos_token_id
    assert sp.bos_token_id not in sp.encode("hi", add_special_tokens=False)
    llama3, _ = pairs["bytelevel_bos"]
    assert llama3.encode("hi")[0] == llama3.bos_token_id == llama3.token_to_id("<|begin_of_text|>")
    qwen, _ = pairs["bytelevel"]
    assert qwen.bos_token_id is None
    assert qwen.encode("hi") == qwen.encode("hi", add_special_tokens=False)


def test_add_bos_token_in_config_is_ignored_like_transformers(folders, tmp_path: Path) -> None:
    # transformers 5 lets tokenizer.json's post-processor decide whenever that file exists.
    folder = _copy_folder(folders["sentencepiece"], tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(add_bos_token=False, add_eos_token=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert Tokenizer.from_pretrained(folder).encode("hi there") == theirs.encode("hi there")


_TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("abcxyz ABC\n\t.,!?()[]{}<>|/_-=+*'\"0123456789")),
        st.sampled_from(list("你好世界中文한국어éèñüßÅØ😀🎉🦀👍🏽❤️\u0301\u200d")),
        st.characters(codec="utf-8"),
    ),
    max_size=40,
)


@pytest.mark.parametrize("style", STYLES)
@settings(max_examples=150, deadline=None)
@given(text=_TEXT)
def test_random_text_round_trips_like_transformers(pairs, style: str, text: str) -> None:
    ours, theirs = pairs[style]
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert max(ids, default=0) < ours.vocab_size
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


# ---- vocabulary ----


@pytest.mark.parametrize("style", STYLES)
def test_vocabulary_matches_transformers(pairs, style: str) -> None:
    ours, theirs = pairs[style]
    assert ours.vocab_size == len(theirs) <= 512  # tiny models use vocab_size 512
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.pad_token_id == theirs.pad_token_id
    assert ours.all_special_ids == theirs.all_special_ids
    for token_id in range(ours.vocab_size):
        token = theirs.convert_ids_to_tokens(token_id)
        assert ours.id_to_token(token_id) == token
        assert ours.token_to_id(token) == token_id
    assert ours.id_to_token(ours.vocab_size) is None
    assert ours.token_to_id("not a token at all") is None


def test_model_max_length(pairs) -> None:
    assert pairs["bytelevel"][0].model_max_length == 32768
    assert pairs["sentencepiece"][0].model_max_length == 4096


def test_named_special_token_is_made_special(folders, tmp_path: Path) -> None:
    # tokenizer.json lists <|im_end|> as a plain added token; being the eos_token makes it special,
    # so skip_special_tokens drops it, as in transformers.
    folder = _copy_folder(folders["bytelevel"], tmp_path / "tok")
    data = json.loads((folder / "tokenizer.json").read_text())
    for token in data["added_tokens"]:
        if token["content"] == "<|im_end|>":
            token["special"] = False
    (folder / "tokenizer.json").write_text(json.dumps(data))
    ours = Tokenizer.from_pretrained(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ids = ours.encode("hi<|im_end|>")
    assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True) == "hi"


def test_special_token_missing_from_vocab_is_added(folders, tmp_path: Path) -> None:
    folder = _copy_folder(folders["bytelevel"], tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|brand_new|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_pretrained(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert ours.bos_token_id == theirs.bos_token_id == ours.vocab_size - 1
    assert ours.encode("a<|brand_new|>b") == theirs.encode("a<|brand_new|>b")


def test_added_tokens_decoder_entries_missing_from_tokenizer_json_are_added(folders, tmp_path: Path) -> None:
    folder = _copy_folder(folders["bytelevel"], tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    data = json.loads((folder / "tokenizer.json").read_text())
    config["added_tokens_decoder"] = {str(t["id"]): t for t in data["added_tokens"]}
    config["added_tokens_decoder"]["502"] = {
        "content": "<extra>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
        "special": True,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_pretrained(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    assert ours.vocab_size == len(theirs) == 503
    assert ours.encode("a<extra>b") == theirs.encode("a<extra>b")
    assert ours.token_to_id("<extra>") == 502
    assert ours.decode([502]) == theirs.decode([502], skip_special_tokens=True) == ""


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


# ---- chat templates ----


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(pairs, style: str, add_generation_prompt: bool, conversation: int):
    ours, theirs = pairs[style]
    messages = CONVERSATIONS[conversation]
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    expected_ids = theirs.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == expected_ids


def test_chat_template_with_tools_and_tool_calls(pairs) -> None:
    ours, theirs = pairs["bytelevel"]
    messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,  # as OpenAI clients send it; the key is dropped before rendering
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "21 °C"},
    ]
    expected = theirs.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    rendered = ours.apply_chat_template(messages, tools=[WEATHER_TOOL])
    assert rendered == expected
    assert '"description": "Weather at a place <and> time, in °C"' in rendered  # tojson keeps text as is


def test_chat_template_extra_variables(pairs) -> None:
    ours, theirs = pairs["bytelevel_bos"]
    messages = CONVERSATIONS[1]
    expected = theirs.apply_chat_template(messages, tokenize=False, date_string="01 Jan 2000")
    assert ours.apply_chat_template(messages, add_generation_prompt=False, date_string="01 Jan 2000") == expected
    assert "Today Date: 01 Jan 2000" in expected


def test_content_parts_render_like_transformers(pairs) -> None:
    ours, theirs = pairs["bytelevel"]
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected


def test_raise_exception_in_template_is_a_value_error(pairs) -> None:
    ours, _ = pairs["sentencepiece"]
    bad_order = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="roles must alternate"):
        ours.apply_chat_template(bad_order)


def test_runtime_error_in_template_is_a_value_error(folders, tmp_path: Path) -> None:
    folder = _with_config(folders["bytelevel"], tmp_path / "tok", chat_template="{{ messages[0].content + 1 }}")
    with pytest.raises(ValueError, match="chat template error: TypeError"):
        Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "user", "content": "hi"}])


def test_empty_conversation_is_rejected(pairs) -> None:
    with pytest.raises(ValueError, match="empty"):
        pairs["bytelevel"][0].apply_chat_template([])


def _with_config(src: Path, dst: Path, **changes) -> Path:
    folder = _copy_folder(src, dst)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_model_without_chat_template(folders, tmp_path: Path) -> None:
    folder = _with_config(folders["bytelevel"], tmp_path / "tok", chat_template=None)
    tokenizer = Tokenizer.from_pretrained(folder)
    assert not tokenizer.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_broken_template_fails_on_use_not_on_load(folders, tmp_path: Path) -> None:
    folder = _with_config(folders["bytelevel"], tmp_path / "tok", chat_template="{% for m in messages %}")
    tokenizer = Tokenizer.from_pretrained(folder)
    assert tokenizer.encode("still works")
    with pytest.raises(ValueError, match="chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_sandbox_blocks_internals(folders, tmp_path: Path) -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    folder = _with_config(folders["bytelevel"], tmp_path / "tok", chat_template=escape)
    with pytest.raises(ValueError, match="chat template error"):
        Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "user", "content": "hi"}])
    namespace_escape = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
    folder = _with_config(folders["bytelevel"], tmp_path / "tok2", chat_template=namespace_escape)
    with pytest.raises(ValueError, match="underscore"):
        Tokenizer.from_pretrained(folder).apply_chat_template([{"role": "user", "content": "hi"}])


def test_block_whitespace_is_trimmed_like_transformers(folders, tmp_path: Path) -> None:
    # trim_blocks/lstrip_blocks: a block tag's own line leaves no newline or indent behind.
    template = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "User: {{ m.content }}\n"
        "    {% else %}\n"
        "Bot: {{ m.content }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}Bot:{% endif %}"
    )
    folder = _with_config(folders["bytelevel"], tmp_path / "tok", chat_template=template)
    ours = Tokenizer.from_pretrained(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    messages = CONVERSATIONS[2]
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert expected.startswith("User: Hello 😀\nBot: Hi! 你好\n")


def test_chat_template_jinja_file_wins_over_config(folders, tmp_path: Path) -> None:
    folder = _copy_folder(folders["bytelevel"], tmp_path / "tok")
    template = "{{ bos_token or '' }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
    (folder / "chat_template.jinja").write_text(template)
    ours = Tokenizer.from_pretrained(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False) == "[x][y]"


def test_named_templates_pick_tool_use_when_tools_are_given(folders, tmp_path: Path) -> None:
    templates = [
        {"name": "default", "template": "plain:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}:{{ messages[0].content }}"},
    ]
    folder = _with_config(folders["bytelevel"], tmp_path / "tok", chat_template=templates)
    ours = Tokenizer.from_pretrained(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages, tokenize=False) == "plain:hi"
    with_tools = theirs.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False)
    assert ours.apply_chat_template(messages, tools=[WEATHER_TOOL]) == with_tools == "tools:1:hi"
