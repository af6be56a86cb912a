"""Load balancing without a trainer: the cost model (`cost`), packing samples into microbatches
(`packing`), the balancers LocalSort / LB-Micro / LB-Mini / LB-Steal (`plan`) and the bubble-rate
simulator (`simulate`). Needs numpy only."""
from jaxodc.balance.cost import CostModel
from jaxodc.balance.plan import BALANCERS, Plan, make_plan
from jaxodc.balance.simulate import bubble_rate, simulate

__all__ = ["BALANCERS", "CostModel", "Plan", "bubble_rate", "make_plan", "simulate"]
