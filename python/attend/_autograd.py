"""torch.autograd functions over attend's fused forward and backward. Imported only when a
torch tensor that requires grad reaches attend, so importing attend never imports torch.

The forward saves its output and one log-sum-exp per query row (never the Lq x Lk weights);
the backward recomputes the weights tile by tile and regenerates dropout from the seed. Both
are deterministic: the same inputs give the same gradients bit for bit at any thread count.
"""

import torch
from torch.autograd.function import once_differentiable

from . import _attend


class _Attention(torch.autograd.Function):
    """(query, key, value, bias, sinks) -> (output, weights or None); `config` holds the rest
    of the call (mask, rules without sinks, scale, dropout, seed, flags, threads)."""

    @staticmethod
    def forward(ctx, config, query, key, value, bias, sinks):
        mask, rules, scale, dropout, seed, flags, num_threads = config
        rules = _with_sinks(rules, sinks)
        output, weights, logsumexp = _attend.sdpa(
            query, key, value, mask, bias, rules, scale, dropout, seed,
            flags | _attend.FLAG_NEED_LOGSUMEXP, num_threads, None)
        ctx.config = config
        ctx.save_for_backward(query, key, value, bias, sinks, output, logsumexp)
        if weights is not None:
            ctx.mark_non_differentiable(weights)
        return output, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output, grad_weights):
        mask, rules, scale, dropout, seed, flags, num_threads = ctx.config
        query, key, value, bias, sinks, output, logsumexp = ctx.saved_tensors
        rules = _with_sinks(rules, sinks)
        needs = ctx.needs_input_grad  # (config, query, key, value, bias, sinks)
        d_query, d_key, d_value, d_bias, d_sinks = _attend.sdpa_backward(
            grad_output, query, key, value, output, logsumexp, mask, bias, rules, scale,
            dropout, seed, flags, num_threads, bool(needs[4]), bool(needs[5]))
        return (None, d_query if needs[1] else None, d_key if needs[2] else None,
                d_value if needs[3] else None, d_bias, d_sinks)


def _with_sinks(rules, sinks):
    if sinks is None:
        return rules
    return rules._replace(sinks=sinks)


def sdpa(query, key, value, mask, bias, rules, sinks, scale, dropout, seed, flags,
         num_threads):
    """attend._attend.sdpa as a differentiable function: (output, weights or None)."""
    if rules is not None and sinks is not None:
        rules = rules._replace(sinks=None)  # sinks travel as an input, for their gradient
    config = (mask, rules, scale, dropout, seed, flags, num_threads)
    return _Attention.apply(config, query, key, value, bias, sinks)


class _MultiheadAttention(torch.autograd.Function):
    """attend.MultiheadAttention's C++ module, differentiable in query, key, value and its
    parameters (given in the order of `names`)."""

    @staticmethod
    def forward(ctx, module, config, names, query, key, value, *parameters):
        padding, mask, causal, need_weights, average, dropout, seed, num_threads = config
        output, weights, tape = _attend.multihead_forward(
            module, query, key, value, padding, mask, causal, need_weights, average, dropout,
            seed, num_threads, True)
        ctx.module, ctx.config, ctx.names, ctx.tape = module, config, names, tape
        ctx.save_for_backward(query, key, value)
        if weights is not None:
            ctx.mark_non_differentiable(weights)
        return output, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output, grad_weights):
        padding, mask, causal, _, _, dropout, seed, num_threads = ctx.config
        query, key, value = ctx.saved_tensors
        # One gradient per distinct tensor (self-attention: all of it in d_query); autograd
        # adds the slots of a tensor passed more than once.
        d_query, d_key, d_value, d_parameters = ctx.module.backward(
            grad_output, query, key, value, ctx.tape, padding, mask, causal, dropout, seed,
            num_threads)
        ctx.tape = None
        return (None, None, None, d_query, d_key, d_value) + tuple(
            d_parameters[name] for name in ctx.names)


def multihead(module, names, parameters, query, key, value, config):
    return _MultiheadAttention.apply(module, config, names, query, key, value, *parameters)
