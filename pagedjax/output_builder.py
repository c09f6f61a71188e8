"""Building a request's `RequestOutput` (`pagedjax.outputs`): finished, aborted or
partial, its completions' texts and, with output_kind DELTA, only what is new.

`OutputBuilderMixin` is a base of `outputs.OutputProcessor` (it reads the processor's
`detokenize`), apart from it because building an output only reads a request's
sequences (and its record of what earlier outputs returned), where `outputs` applies
the sampled tokens (stop checks, beam selection) that change them. A completion's text
is cut where a stop string stopped it, less the stop token's text (as vLLM's); a partial
output's text is only what no later token changes.
"""

from __future__ import annotations

import dataclasses
from time import perf_counter
from typing import TYPE_CHECKING

from pagedjax.request import CompletionOutput, RequestOutput, RequestOutputKind
from pagedjax.sequence import Sequence as Seq

if TYPE_CHECKING:
    from pagedjax.outputs import Request

__all__ = ["OutputBuilderMixin"]


class OutputBuilderMixin:
    """`outputs.OutputProcessor`'s outputs: a request's `RequestOutput`, its texts, DELTA."""

    def output(
        self,
        req: Request,
        *,
        aborted: bool,
        now: float | None = None,
        running: bool = False,
        with_text: bool = True,
    ) -> RequestOutput:
        """The request's `RequestOutput`: finished, or (`aborted`) what it has so far, or
        (`running`) its partial output; only what is new with output_kind DELTA.
        `with_text` False: every completion's text "" (nothing is decoded), the fallback
        when building it with text raised (a tokenizer's decode error)."""
        now = perf_counter() if now is None else now
        g, p = req.group, len(req.prompt_ids)
        comps = []
        n = req.params.n
        hyps = [] if req.beam is None else req.beam.best(n)
        if hyps:
            for i, h in enumerate(hyps):
                # Ended on a stop token (EOS or stop_token_ids): that token, as sampling.
                stop = h.token_ids[-1] if h.finish_reason == "stop" else None
                comps.append(
                    CompletionOutput(
                        i,
                        self._text(req, h.token_ids, stop) if with_text else "",
                        h.token_ids,
                        h.cumulative_logprob,
                        h.logprobs,
                        h.finish_reason,
                        stop,
                    )
                )
        if len(hyps) < n:  # sampling's sequences; a beam search aborted short of n
            seqs = g.finished + (g.seqs + g.forks if aborted or running else [])
            seqs = sorted(seqs, key=lambda s: s.index)
            if req.beam is not None:  # the best running beams after the hypotheses
                seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: n - len(hyps)]
            for rank, s in enumerate(seqs, len(hyps)):
                gen = s.token_ids[p:]
                text = req.texts.get(s.seq_id)  # (a finished one's, in an earlier output)
                if not with_text:
                    text = ""
                elif text is None:
                    text = self._seq_text(req, s, gen, running)
                    if s.finish_reason is not None:
                        req.texts[s.seq_id] = text
                comps.append(
                    CompletionOutput(
                        rank if req.beam is not None else s.index,  # beams all have index 0
                        text,
                        gen,
                        s.cumulative_logprob,
                        None if s.logprobs is None else list(s.logprobs),
                        s.finish_reason,
                        s.stop_reason,
                    )
                )
        if req.params.output_kind == RequestOutputKind.DELTA:
            comps = [self._delta(req, c) for c in comps]
        first = g.num_cached_tokens or 0  # None: aborted before its admission
        return RequestOutput(
            req.request_id,
            req.prompt,
            list(req.prompt_ids),
            comps,
            not running,  # (an aborted request's output is its last, as a finished one's)
            first,
            g.num_preemptions,
            None if req.first_token is None else req.first_token - req.arrival,
            now - req.arrival,
            None if req.prompt_logprobs is None else list(req.prompt_logprobs),
            req.lora_request,
        )

    def _seq_text(self, req: Request, s: Seq, gen: list[int], running: bool) -> str:
        """The text of sequence `s` (generated tokens `gen`) in an output: cut where a
        stop string stopped it; while it runs (a partial output), only what no later
        token changes, read from its incremental detokenizer where it has one, less
        what a stop string forming at its end would cut (unless the stop string is kept:
        include_stop_str_in_output, as vLLM holds nothing back then)."""
        if running and s.finish_reason is None and s.detok is not None:
            # Its settled text, not `text + pending`: a trailing run of byte-fallback
            # tokens ("€") decodes as U+FFFD per byte once an invalid byte joins it, so
            # an earlier piece would not be a prefix of the final text.
            text = s.detok.text
        else:
            text = self._text(req, gen, s.stop_reason)
        if isinstance(s.stop_reason, str):  # cut where it stopped (not earlier:
            # min_tokens may have let an earlier occurrence through)
            i = text.find(s.stop_reason, s.stop_pos)
            i = i if i >= 0 else text.rfind(s.stop_reason)
            if i >= 0 and req.params.include_stop_str_in_output:
                i += len(s.stop_reason)
            text = text[:i] if i >= 0 else text
        elif running and s.finish_reason is None:  # what no later token changes
            text = text.rstrip("\ufffd")
            if req.params.stop and not req.params.include_stop_str_in_output:
                # (kept, a stop string ends past the text settled before its last token)
                held = max(map(len, req.params.stop)) - 1
                text = text[: max(0, len(text) - held)]
        return text

    def take_back(self, req: Request, out: RequestOutput) -> None:
        """Undoes a partial output of `req` that no caller got (one held for a later
        `step()` and then dropped): with output_kind DELTA its tokens and text go to the
        request's next output instead; a CUMULATIVE one repeats them anyway."""
        if req.params.output_kind != RequestOutputKind.DELTA:
            return
        for c in out.outputs:
            n, chars = req.sent[c.index]
            req.sent[c.index] = (n - len(c.token_ids), chars - len(c.text))

    def _delta(self, req: Request, c: CompletionOutput) -> CompletionOutput:
        """`c` less what earlier outputs of the request returned (output_kind DELTA)."""
        n, chars = req.sent.get(c.index, (0, 0))
        req.sent[c.index] = (len(c.token_ids), max(chars, len(c.text)))
        return dataclasses.replace(
            c,
            text=c.text[chars:],
            token_ids=c.token_ids[n:],
            logprobs=None if c.logprobs is None else c.logprobs[n:],
        )

    def _text(self, req: Request, gen: list[int], stop: int | str | None) -> str:
        """The text of a completion's tokens `gen` that ended on `stop` (its stop_reason),
        less the stop token's text (EOS's, a stop_token_ids one's) unless
        include_stop_str_in_output, as vLLM's."""
        sp = req.params
        if not sp.detokenize:
            return ""
        if isinstance(stop, int) and not sp.include_stop_str_in_output:
            gen = gen[:-1]
        return self.detokenize(gen, req.prompt_ids, sp.skip_special_tokens)
