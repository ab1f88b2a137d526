"""Tuning a drafting method's settings to a target on calibration prompts, measured, not
trained: `layer_skip` (which layers the target's self-draft leaves out). The CLI command is
`forerun tune`; the settings found are kept where their method reads them."""
