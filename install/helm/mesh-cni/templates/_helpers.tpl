{{/*
The agent image: pinned by digest unless only a tag is given.
*/}}
{{- define "mesh-cni.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else if .Values.image.tag -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- else -}}
{{ fail "image: set image.digest (or image.tag) of the mesh-agent image" }}
{{- end -}}
{{- end -}}

{{/*
Refuses combinations the agent would refuse at start, with its reason.
*/}}
{{- define "mesh-cni.validate" -}}
{{- if and .Values.zds.enabled (ne .Values.enrollment "kubernetes") (not .Values.zds.withoutServiceAccounts) -}}
{{- fail (printf "enrollment: %s cannot know pods' service accounts, which a ZDS node proxy such as ztunnel needs (only enrollment: kubernetes reads them): set enrollment: kubernetes, zds.enabled: false, or zds.withoutServiceAccounts: true for a node proxy that does not use them" .Values.enrollment) -}}
{{- end -}}
{{- if and (eq .Values.enrollment "file") (not .Values.policy) -}}
{{- fail "enrollment: file needs a policy (the agent is not ready until it has a valid one)" -}}
{{- end -}}
{{- end -}}

{{/*
Labels of every object, as install/kubernetes sets them.
*/}}
{{- define "mesh-cni.labels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/part-of: mesh-cni
{{- end -}}
