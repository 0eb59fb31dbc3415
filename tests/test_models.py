"""Our GPT-2 and BERT against Hugging Face's: same weights in, same outputs out, both directions.

The vocabularies here (100 words) are padded to 128 rows in our models: logits, losses, samples and
saved files must not show it.
"""

import pytest
import torch

from fsdp_mpi_models.bert import BertForPreTraining, BertForSequenceClassification, bert_config
from fsdp_mpi_models.checkpoint import PretrainedCheckpointError
from fsdp_mpi_models.gpt2 import GPT2_CONFIGS, GPT2LMHeadModel, generate, gpt2_config

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.one_mpi  # no MPI in it: CI's second MPI would run it for nothing
TOLERANCE = 1e-5


def hf_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


def hf_bert(cls=None):
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                                     vocab_size=100, max_position_embeddings=40, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3)
    return (cls or transformers.BertForPreTraining)(config).eval()


def bert_inputs():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 100, (3, 12), generator=generator)
    token_type_ids = (torch.arange(12) >= 6).long().expand(3, 12)
    attention_mask = torch.ones(3, 12, dtype=torch.long)
    attention_mask[1, 8:] = 0  # padding
    return input_ids, token_type_ids, attention_mask


def max_difference(a, b) -> float:
    return (a - b).abs().max().item()


def saved_shapes(directory) -> dict[str, tuple]:
    from safetensors import safe_open
    with safe_open(str(directory / "model.safetensors"), framework="pt") as file:
        return {key: tuple(file.get_slice(key).get_shape()) for key in file.keys()}


def test_gpt2_loads_hf_weights_and_matches_logits_and_loss(tmp_path):
    hf = hf_gpt2()
    hf.save_pretrained(tmp_path)
    ours = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 100, (2, 20))
    logits, loss = ours(tokens[:, :-1], tokens[:, 1:])
    reference = hf(tokens, labels=tokens)  # HF shifts the labels itself
    assert logits.shape == (2, 19, 100)
    assert max_difference(logits, reference.logits[:, :-1]) <= TOLERANCE
    assert abs(loss.item() - reference.loss.item()) <= TOLERANCE
    assert ours.lm_head.weight is ours.transformer.wte.weight
    assert ours.transformer.wte.weight.shape == (128, 64) and not ours.transformer.wte.weight[100:].any()


def test_the_padded_vocabulary_never_shows_in_logits_loss_samples_or_gradients():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", vocab_size=100)).eval()
    tokens = torch.randint(0, 100, (2, 17))
    logits, loss = model(tokens[:, :-1], tokens[:, 1:])
    with torch.no_grad():  # padding rows that would win every softmax if they took part
        model.lm_head.weight[100:] = 10 * model.transformer.ln_f(model.transformer(tokens)).mean((0, 1))
    padded_logits, padded_loss = model(tokens[:, :-1], tokens[:, 1:])
    assert torch.equal(padded_logits, logits) and torch.equal(padded_loss, loss)
    padded_loss.backward()
    assert not model.lm_head.weight.grad[100:].any()
    # Near-uniform sampling (temperature 1000) over 128 columns would draw a padding id about once in 5 tokens.
    sampled = model.generate(tokens[:, :3], 60, temperature=1000.0, generator=torch.Generator().manual_seed(0))
    assert int(sampled.max()) < 100 and len(set(sampled.flatten().tolist())) > 50


def test_hf_loads_our_gpt2_and_matches_logits_and_it_reloads(tmp_path):
    torch.manual_seed(0)
    ours = GPT2LMHeadModel(gpt2_config("gpt2-tiny", vocab_size=100, n_head=4)).eval()
    ours.save_pretrained(tmp_path)
    assert saved_shapes(tmp_path)["transformer.wte.weight"] == (100, 64)  # Hugging Face's shapes
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, 100, (2, 20))
    assert max_difference(ours(tokens)[0], hf(tokens).logits) <= TOLERANCE
    again = GPT2LMHeadModel.from_pretrained(tmp_path)
    for (name, tensor), reloaded in zip(ours.state_dict().items(), again.state_dict().values()):
        assert torch.equal(tensor, reloaded), name


def test_gpt2_loads_original_style_checkpoint_file(tmp_path):
    """OpenAI-era files: no 'transformer.' prefix, mask buffers, no lm_head, a bare .bin without config."""
    hf = hf_gpt2()
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    torch.save(state, tmp_path / "gpt2.bin")
    ours = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2.bin", n_head=4).eval()
    tokens = torch.randint(0, 100, (2, 20))
    assert max_difference(ours(tokens)[0], hf(tokens).logits) <= TOLERANCE


def test_bert_pretraining_matches_hf_both_ways(tmp_path):
    hf = hf_bert()
    hf.save_pretrained(tmp_path / "hf")
    ours = BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    inputs = bert_inputs()
    real = inputs[2].bool()  # HF and we differ only in what padded positions see
    mlm_labels = torch.where(real & (torch.arange(12) % 3 == 0), inputs[0], -100)
    nsp_labels = torch.tensor([0, 1, 1])
    mlm, nsp, loss = ours(*inputs, mlm_labels=mlm_labels, nsp_labels=nsp_labels)
    reference = hf(input_ids=inputs[0], token_type_ids=inputs[1], attention_mask=inputs[2], labels=mlm_labels,
                   next_sentence_label=nsp_labels)
    assert mlm.shape == (3, 12, 100) and ours.bert.embeddings.word_embeddings.weight.shape == (128, 64)
    assert max_difference(mlm[real], reference.prediction_logits[real]) <= TOLERANCE
    assert max_difference(nsp, reference.seq_relationship_logits) <= TOLERANCE
    assert abs(loss.item() - reference.loss.item()) <= TOLERANCE
    assert ours.cls.predictions.decoder.weight is ours.bert.embeddings.word_embeddings.weight

    ours.save_pretrained(tmp_path / "ours")
    shapes = saved_shapes(tmp_path / "ours")
    assert shapes["bert.embeddings.word_embeddings.weight"] == (100, 64) and shapes["cls.predictions.bias"] == (100,)
    back = transformers.BertForPreTraining.from_pretrained(tmp_path / "ours").eval()
    again = back(input_ids=inputs[0], token_type_ids=inputs[1], attention_mask=inputs[2])
    assert max_difference(again.prediction_logits[real], mlm[real]) <= TOLERANCE
    reloaded = BertForPreTraining.from_pretrained(tmp_path / "ours").state_dict()
    assert all(torch.equal(tensor, reloaded[name]) for name, tensor in ours.state_dict().items())


def test_bert_classifier_matches_hf_and_starts_from_a_pretraining_checkpoint(tmp_path):
    hf = hf_bert(transformers.BertForSequenceClassification)
    hf.save_pretrained(tmp_path / "classifier")
    ours = BertForSequenceClassification.from_pretrained(tmp_path / "classifier").eval()
    inputs = bert_inputs()
    reference = hf(input_ids=inputs[0], token_type_ids=inputs[1], attention_mask=inputs[2]).logits
    assert max_difference(ours(*inputs)[0], reference) <= TOLERANCE

    hf_bert().save_pretrained(tmp_path / "pretraining")
    fine_tune = BertForSequenceClassification.from_pretrained(tmp_path / "pretraining", num_labels=3)
    assert fine_tune.classifier.weight.shape == (3, 64)


def test_published_parameter_counts():
    with torch.device("meta"):
        counts = {name: GPT2LMHeadModel(config).num_parameters() for name, config in GPT2_CONFIGS.items()}
        bert_base = BertForPreTraining(bert_config("bert-base")).num_parameters()
        hf_bert_base = transformers.BertForPreTraining(transformers.BertConfig()).num_parameters()
        bert_seed = BertForPreTraining(bert_config("bert-seed")).num_parameters()
    assert counts["gpt2"] == 124_439_808
    assert counts["gpt2-medium"] == 354_823_168
    assert counts["gpt2-large"] == 774_030_080
    assert counts["gpt2-xl"] == 1_557_611_200
    assert counts["gpt2-tiny"] < 1_000_000
    assert bert_base == hf_bert_base == 110_106_428
    assert bert_seed == pytest.approx(46.7e6, rel=0.001)


def test_tying_survives_optimizer_steps():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        tokens = torch.randint(0, 128, (2, 9))
        model(tokens[:, :-1], tokens[:, 1:])[1].backward()
        optimizer.step()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.wte.weight.shape == (128, 64)  # a multiple of 64 already: no padding
    bert = BertForPreTraining(bert_config("bert-tiny", vocab_size=50))
    assert bert.cls.predictions.decoder.bias is bert.cls.predictions.bias


def test_generate_extends_the_sequence_reproducibly():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    prompt = torch.zeros(1, 3, dtype=torch.long)
    first = generate(model, prompt, 70, top_k=5, generator=torch.Generator().manual_seed(1))
    second = model.generate(prompt, 70, top_k=5, generator=torch.Generator().manual_seed(1))
    assert first.shape == (1, 73) and torch.equal(first, second) and torch.equal(first[:, :3], prompt)


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    checkpointed = GPT2LMHeadModel(gpt2_config("gpt2-tiny", gradient_checkpointing=True))
    checkpointed.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, 128, (2, 9))
    for model in (plain, checkpointed):
        model(tokens[:, :-1], tokens[:, 1:])[1].backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-7), name


def test_unknown_config_names():
    with pytest.raises(ValueError, match="unknown GPT-2 config 'gpt3'; choose one of gpt2-tiny"):
        gpt2_config("gpt3")
    with pytest.raises(ValueError, match="unknown BERT config 'bert-huge'"):
        bert_config("bert-huge")


def test_bad_checkpoints_are_named(tmp_path):
    with pytest.raises(PretrainedCheckpointError, match="no such file or directory"):
        GPT2LMHeadModel.from_pretrained(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PretrainedCheckpointError, match="contains none of model.safetensors, pytorch_model.bin"):
        GPT2LMHeadModel.from_pretrained(tmp_path / "empty")
    (tmp_path / "garbage.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(PretrainedCheckpointError, match="not a readable safetensors file"):
        GPT2LMHeadModel.from_pretrained(tmp_path / "garbage.safetensors")

    hf = hf_gpt2()
    hf.save_pretrained(tmp_path / "hf")
    state = dict(hf.state_dict())
    del state["transformer.h.1.mlp.c_fc.bias"]
    state["transformer.ln_f.weight"] = torch.ones(7)
    state["transformer.extra"] = torch.ones(1)
    torch.save(state, tmp_path / "broken.bin")
    with pytest.raises(PretrainedCheckpointError) as error:
        GPT2LMHeadModel.from_pretrained(tmp_path / "broken.bin", n_head=4)
    message = str(error.value)
    assert "missing: transformer.h.1.mlp.c_fc.bias" in message
    assert "unexpected: transformer.extra" in message
    assert "transformer.ln_f.weight: checkpoint (7,), model (64,)" in message


def test_bert_predicting_only_masked_positions_gives_those_rows_loss_and_gradients():
    torch.manual_seed(0)
    config = bert_config("bert-tiny", vocab_size=50)
    model = BertForPreTraining(config)
    model.eval()  # no dropout: both passes must see the same network
    input_ids = torch.randint(0, 50, (3, 12))
    labels = torch.where(torch.rand(3, 12) < 0.3, input_ids, torch.full_like(input_ids, -100))
    labels[2] = -100  # a sample with nothing to predict
    nsp = torch.tensor([0, 1, 0])
    predicted = labels != -100
    full_logits, _, full_loss = model(input_ids, mlm_labels=labels, nsp_labels=nsp)
    full_loss.backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits, _, loss = model(input_ids, mlm_labels=labels, nsp_labels=nsp, predict_positions=predicted)
    loss.backward()
    assert logits.shape == (int(predicted.sum()), 50)
    torch.testing.assert_close(logits, full_logits[predicted])
    torch.testing.assert_close(loss, full_loss)
    for full, partial in zip(full_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(partial, full)
    hidden, vocab = config.hidden_size, config.vocab_size
    assert (model.training_flops_per_token(12) - model.training_flops_per_token(12, predicted_fraction=0.15)
            == pytest.approx(6 * 0.85 * (hidden * hidden + vocab * hidden)))
