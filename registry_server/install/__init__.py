"""An installed toolreg and its host: what the wheel carries (the example tools, the
image build contexts, the init), building the sandbox images from them, and
`toolreg doctor`'s checks of a host before it is trusted (docs/how-to/deploying.md)."""
