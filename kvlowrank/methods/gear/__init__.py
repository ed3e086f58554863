"""GEAR (Kang et al. 2024): quantized backbone + sparse outliers + low-rank residual.

spec.py: GearSpec (variants GEAR / GEAR-L / outlier-only); backbone.py: the quantizer
interface the residual layer sits on (KIVI, KCVT; why not Palu/XQuant); outliers.py: S;
power.py: Algorithm 2; cache.py: GearCache (Algorithm 1, streaming, factored attention);
method.py: its registration; size.py: KV bytes/token, ours and the paper's Table 9
convention. The decode kernel: kernels/gear (wired in at merge).
"""

from kvlowrank.methods.gear.cache import GearCache
from kvlowrank.methods.gear.spec import GearSpec
from kvlowrank.methods.gear import method as _method  # noqa: F401  (registers "gear")
