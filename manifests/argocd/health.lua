-- Argo CD health check for gpudra.io/GpuDraConfig.
--
-- Argo CD has no built-in health for custom resources. Install this as
-- resource.customizations.health.gpudra.io_GpuDraConfig in argocd-cm (manifests/argocd/README.md).
--
--   Progressing  being deleted; no status yet; the operator has not observed the latest spec
--                (status.observedGeneration, or the Ready condition's, lags metadata.generation);
--                or Ready is not True while nothing is wrong (agents rolling out).
--   Degraded     Degraded=True: a person has to act (a template that does not render, an object
--                the API server refused, a conflict with another GpuDraConfig).
--   Healthy      Ready=True for the current generation.
local hs = {}
local meta = obj.metadata or {}
local generation = meta.generation or 0

if meta.deletionTimestamp ~= nil then
  hs.status = "Progressing"
  hs.message = "Pending deletion"
  return hs
end

local status = obj.status
if status == nil or status.observedGeneration == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the gpudra operator to report status"
  return hs
end
if status.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the gpudra operator to observe generation " .. generation ..
      " (status is for generation " .. status.observedGeneration .. ")"
  return hs
end

local ready = nil
local degraded = nil
for _, condition in ipairs(status.conditions or {}) do
  if condition.type == "Ready" then
    ready = condition
  elseif condition.type == "Degraded" then
    degraded = condition
  end
end

local function current(condition)
  return condition.observedGeneration == nil or condition.observedGeneration >= generation
end

if degraded ~= nil and degraded.status == "True" and current(degraded) then
  hs.status = "Degraded"
  hs.message = (degraded.reason or "Degraded") .. ": " .. (degraded.message or "")
  return hs
end
if ready ~= nil and current(ready) then
  if ready.status == "True" then
    hs.status = "Healthy"
    hs.message = ready.message or "Ready"
    return hs
  end
  hs.status = "Progressing"
  hs.message = (ready.reason or "NotReady") .. ": " .. (ready.message or "")
  return hs
end
hs.status = "Progressing"
hs.message = "Waiting for the Ready condition of generation " .. generation
return hs
