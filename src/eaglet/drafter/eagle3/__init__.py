"""EAGLE-3: one Llama layer drafting a chain, one token a pass, trained with training-time test
(`model`: `Eagle3Draft` and its TTT unroll). Its family, `eaglet.families.EAGLE3`, names this
package's model; its objective is `eaglet.drafter.objectives.ttt_loss`, its decoding
`eaglet.decode`'s chain and tree."""

from eaglet.drafter.eagle3.model import DraftOutput, Eagle3Draft, shift_left

__all__ = ["DraftOutput", "Eagle3Draft", "shift_left"]
