from evictlab.cache.policies import POLICIES, Policy, make_policy

__all__ = ["POLICIES", "Policy", "make_policy"]
