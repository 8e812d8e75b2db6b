"""EngineConfig as the one carrier of engine options: built once, with every "auto" decided, and the
same after crossing to the engine process through the message codec."""

from __future__ import annotations

import pytest

from ferry.assets import default_model_path
from ferry.config import EngineConfig
from ferry.engine.messages import decode_config, encode_config


def test_create_decides_every_auto_default_on_a_cpu():
    config = EngineConfig.create(default_model_path(), max_num_seqs=7, block_size=8)
    assert config.model.dtype == "float32"  # "auto" on a CPU
    assert config.enforce_eager is True and config.async_scheduling is False
    assert config.scheduler.max_num_batched_tokens == 2048
    assert config.scheduler.max_num_seqs == 7 and config.cache.block_size == 8
    assert config.model.max_model_len == config.scheduler.max_model_len


def test_an_unknown_option_is_named_with_its_closest_match():
    with pytest.raises(TypeError, match="max_num_seq.*did you mean max_num_seqs"):
        EngineConfig.create(default_model_path(), max_num_seq=4)


def test_the_config_crosses_the_codec_unchanged():
    config = EngineConfig.create(default_model_path(), max_num_seqs=5, cuda_graph_batch_sizes=[1, 3],
                                 enable_prefix_caching=False, seed=11, tokenizer=default_model_path())
    assert decode_config(encode_config(config)) == config


@pytest.mark.parametrize("text", ["[]", '{"model": {}}', "not json", '{"device": "cpu"}'])
def test_a_malformed_config_is_refused(text):
    with pytest.raises(ValueError, match="malformed engine config"):
        decode_config(text)
