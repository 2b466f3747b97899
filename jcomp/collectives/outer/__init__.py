"""The outer loop's sync of islands across a slow axis: cc.outer_sync, SparseLoCo."""
