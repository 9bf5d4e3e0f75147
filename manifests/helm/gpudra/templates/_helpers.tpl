{{/* Labels on every object: the base's, plus Helm's. */}}
{{- define "gpudra.labels" -}}
app.kubernetes.io/part-of: gpudra
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "gpudra.operatorLabels" -}}
app.kubernetes.io/name: gpudra-operator
{{ include "gpudra.labels" . }}
{{- end -}}

{{- define "gpudra.agentLabels" -}}
app.kubernetes.io/name: gpudra-agent
{{ include "gpudra.labels" . }}
{{- end -}}

{{- define "gpudra.operatorImage" -}}
{{- $image := .Values.operator.image -}}
{{- if $image.digest -}}
{{ $image.repository }}@{{ $image.digest }}
{{- else -}}
{{ $image.repository }}:{{ $image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{- define "gpudra.agentImage" -}}
{{- $image := .Values.agent.image -}}
{{- if $image.digest -}}
{{ $image.repository }}@{{ $image.digest }}
{{- else -}}
{{ $image.repository }}:{{ $image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}
