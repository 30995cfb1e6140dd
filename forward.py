"""The trainer's forwards: log-probs of response tokens (the LM head only where they are
predicted), the same rows under two prompts, and the mean hidden state of each response. Every
pass that a rank may have fewer rows for keeps FSDP's lock-step here (every rank runs as many
forwards, an empty one too), so grpo.py and distill.py stay tensor math with no ranks in them.

    row_logprobs(policy, [[5, 6, 7], [8]], [[9, 10, 2], [11, 2]], pad_id=2, temperature=1.0)
    -> [tensor([-3.1, -2.9, -4.0]), tensor([-2.2, -3.5])]          # one [len(response)] per row
    two_context_logprobs(logprobs, firsts=[x, x], seconds=[x~, None], responses=[y1, y2], chunk_size=8)
    -> ([logp(y1|x), logp(y2|x)], [logp(y1|x~), None])            # CRM: x and x~ (distill.crm_weights)
"""

import functools

import torch

import dist
import grpo


def autocast(cfg, device):
    """bf16 autocast for the training forward. Its cache keeps each fp32 weight's bf16 cast until
    the outermost region exits (one process: a step's region, 2 bytes a parameter, cast once a
    step); under FSDP it would keep every gathered layer's cast for the whole forward: off there."""
    return torch.autocast(device.type, torch.bfloat16, enabled=cfg.autocast_bf16, cache_enabled=not dist.active())


def selected_logprobs(model, input_ids, attention, targets, temperature, chunk, with_entropy=False, loss_mask=None,
                      position_ids=None, index=None):
    """Log-probs (and entropy) of the N response tokens `targets`, predicted where loss_mask
    [B, L-1] is set, or (packed rows, grpo.pack_rows: `attention` is then its block ids [S, Lp])
    at the flat positions `index`. The LM head runs there only, `chunk` tokens at a time
    (grpo.head_logprobs: no [N, V] logits). Bound to the policy as a method that FSDP treats
    like forward, so the head's weight is gathered around it."""
    if index is not None:  # packed rows: laid out and masked as this model's attention takes them
        input_ids, attention, position_ids, index = grpo.packed_inputs(input_ids, attention, position_ids, index,
                                                                       model.config._attn_implementation)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids).last_hidden_state
    selected = hidden[:, :-1][loss_mask] if index is None else hidden.flatten(0, 1)[index]  # [N, H]
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("an LM head with a bias is not supported (grpo.head_logprobs)")
    return grpo.head_logprobs(selected, head.weight, targets, temperature, chunk, with_entropy)


def response_logprobs(model, input_ids, attention, loss_mask, temperature, with_entropy=False, packed=None,
                      chunk=1024):
    """Log-probs of the response tokens, computing the LM head only where loss_mask is set.
    input_ids/attention [B, L]; loss_mask [B, L-1] -> logp [B, L-1] (0 off the mask), entropy [N] or None.
    With `packed` (grpo.pack_rows of the same rows) each shared prompt is forwarded once; the
    result is the same, laid out the same."""
    forward = model.selected_logprobs if hasattr(model, "selected_logprobs") else functools.partial(selected_logprobs,
                                                                                                     model)
    targets = input_ids[:, 1:][loss_mask]  # [N]
    where = dict(loss_mask=loss_mask) if packed is None else dict(position_ids=packed.position_ids, index=packed.index)
    selected, ent = forward(input_ids if packed is None else packed.input_ids,
                            attention if packed is None else packed.block, targets, temperature, chunk, with_entropy,
                            **where)
    logp = torch.zeros(loss_mask.shape, dtype=selected.dtype, device=input_ids.device)  # fp32 (fp64 models: fp64)
    logp[loss_mask] = selected
    return logp, ent


def row_logprobs(model, prompts, responses, pad_id, temperature, shared=False, chunk=1024):
    """Each row's response-token log-probs as its own [len(response)] tensor (lists of ids in);
    shared: rows with the same prompt forward it once (grpo.pack_rows). No rows: one stand-in
    forward all the same (under FSDP every rank must run the same forwards), and []."""
    device = next(model.parameters()).device
    rows = (prompts, responses) if prompts else ([[pad_id]], [[pad_id]])
    ids, attention, response_mask = (t.to(device) for t in grpo.make_batch(*rows, pad_id))
    mask = response_mask[:, 1:]  # [B, L-1]
    packed = grpo.pack_rows(*rows, pad_id).to(device) if shared else None
    logp, _ = response_logprobs(model, ids, attention, mask, temperature, packed=packed, chunk=chunk)
    return [row[m] for row, m in zip(logp, mask)] if prompts else []


def two_context_logprobs(logprobs, firsts, seconds, responses, chunk_size):
    """Log-probs of each response under two prompts (CRM: the original x and the templated x~).
    logprobs(prompts, responses) -> one [len(response)] no-grad tensor per row (row_logprobs bound
    to a model); seconds[i] None: row i has no second context and is not forwarded. Each chunk of
    `chunk_size` such rows is one call holding them under their first prompts, then under their
    second. Under torchrun every rank makes as many calls (an empty one too).
    Returns (under_first, under_second): lists with None for the rows without a second prompt."""
    both = [i for i, s in enumerate(seconds) if s is not None]
    chunks = [both[s:s + chunk_size] for s in range(0, len(both), chunk_size)]
    first, second = [None] * len(firsts), [None] * len(firsts)
    for c in range(dist.all_max(len(chunks))):  # FSDP lock-step
        chunk = chunks[c] if c < len(chunks) else []
        out = logprobs([firsts[i] for i in chunk] + [seconds[i] for i in chunk], [responses[i] for i in chunk] * 2)
        for q, i in enumerate(chunk):
            first[i], second[i] = out[q], out[len(chunk) + q]
    return first, second


def response_hidden_mean(model, input_ids, attention, response_mask, position_ids=None, index=None):
    """Each row's pooled final hidden state (the LM head's input, after the last norm), as CLIPO's
    release pools it: the sum of the states at the response's tokens except its last (those its
    engine computed while decoding: the state that predicted the first token is the prompt's,
    the last token is never fed back) divided by the response's length L, i.e. the mean of the
    L - 1 states times (L - 1) / L. input_ids / attention / response_mask [B, L] (grpo.make_batch)
    -> [B, H] fp32; or packed rows (grpo.pack_rows: input_ids, its block ids as `attention`,
    position_ids and index of the same rows; response_mask still the make_batch one, for the
    lengths). Bound to the policy like selected_logprobs, so FSDP gathers the root's weights."""
    lengths = response_mask.sum(1)  # [B]
    if index is None:
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention).last_hidden_state  # [B, L, H]
        fed_back = response_mask & torch.nn.functional.pad(response_mask[:, 1:], (0, 1))  # a token the next one follows
        summed = (hidden.float() * fed_back.unsqueeze(-1)).sum(1)  # [B, H]
    else:  # index[n] predicts response token n, so it is the position of token n - 1 of the same row
        input_ids, mask, position_ids, index = grpo.packed_inputs(input_ids, attention, position_ids, index,
                                                                  model.config._attn_implementation)
        hidden = model.base_model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
        row = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)  # [N]
        first = torch.ones_like(row, dtype=torch.bool)
        first[1:] = row[1:] != row[:-1]  # each row's first token: predicted by the prompt's state
        states = hidden.flatten(0, 1)[index[~first]].float()  # [N - B, H] the states at tokens 0 .. L - 2
        summed = torch.zeros(len(lengths), hidden.shape[-1], device=hidden.device).index_add_(0, row[~first], states)
    return summed / lengths.clamp(min=1)[:, None]


def hidden_means(model, prompts, responses, pad_id, chunk_size, shared=False):
    """response_hidden_mean of every row, `chunk_size` rows a forward, no grad -> [N, H] fp32 on
    the CPU ([0, H] for no rows); shared: rows with the same prompt forward it once
    (grpo.pack_rows). Under torchrun every rank makes as many forwards."""
    device = next(model.parameters()).device
    forward = model.response_hidden_mean if hasattr(model, "response_hidden_mean") else functools.partial(
        response_hidden_mean, model)
    starts = list(range(0, len(prompts), chunk_size))
    out = []
    with torch.no_grad():
        for c in range(dist.all_max(len(starts))):  # FSDP lock-step
            rows = (prompts[starts[c]:starts[c] + chunk_size], responses[starts[c]:starts[c] + chunk_size]) \
                if c < len(starts) else ([[pad_id]], [[pad_id]])
            ids, attention, response_mask = (t.to(device) for t in grpo.make_batch(*rows, pad_id))
            if shared:
                p = grpo.pack_rows(*rows, pad_id).to(device)
                means = forward(p.input_ids, p.block, response_mask, position_ids=p.position_ids, index=p.index)
            else:
                means = forward(ids, attention, response_mask)
            if c < len(starts):
                out.append(means.cpu())
    hidden = model.config.hidden_size
    return torch.cat(out) if out else torch.zeros(0, hidden)


def group_hidden_means(model, groups, prompt_of, pad_id, chunk_size, shared=False):
    """Per group a [K, H] tensor: response_hidden_mean of each of its rollouts (g.samples) under
    the prompt ids prompt_of(g). Each rank forwards its share of the groups (dist.split; FSDP
    lock-step in hidden_means), then every rank holds all of them, in order."""
    mine = dist.split(list(range(len(groups))), dist.rank(), dist.world())
    prompts, responses = [], []
    for gi in mine:
        prompts += [prompt_of(groups[gi])] * len(groups[gi].samples)
        responses += [s.response_ids for s in groups[gi].samples]
    hidden = hidden_means(model, prompts, responses, pad_id, chunk_size, shared)  # [N, H]
    return dist.unsplit(dist.gather_objects(list(torch.split(hidden, [len(groups[gi].samples) for gi in mine]))))
