"""The sharding core, below model/, parallel/ and tensor_parallel/ that all read it: where each
parameter element lives (`layout`: ParamMeta, ParamLayout) and its counter-based initial value
(`init`), so that any grid builds the same numbers."""
