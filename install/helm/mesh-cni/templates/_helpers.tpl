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

{{/*
The platform: the value, or with auto what the cluster says of itself.
*/}}
{{- define "mesh-cni.platform" -}}
{{- if ne .Values.platform "auto" -}}
{{ .Values.platform }}
{{- else if contains "-gke" .Capabilities.KubeVersion.Version -}}
gke
{{- else if contains "-eks-" .Capabilities.KubeVersion.Version -}}
eks
{{- else if contains "+k3s" .Capabilities.KubeVersion.Version -}}
k3s
{{- else if .Capabilities.APIVersions.Has "security.openshift.io/v1" -}}
openshift
{{- else -}}
default
{{- end -}}
{{- end -}}

{{/*
The node's CNI directories: cni.binDir and cni.confDir, else the platform's
(the same table as install/kubernetes/platforms.go and its components).
*/}}
{{- define "mesh-cni.cniBinDir" -}}
{{- $dirs := dict "default" "/opt/cni/bin" "eks" "/opt/cni/bin" "kind" "/opt/cni/bin" "gke" "/home/kubernetes/bin" "k3s" "/var/lib/rancher/k3s/data/cni" "microk8s" "/var/snap/microk8s/current/opt/cni/bin" "openshift" "/var/lib/cni/bin" -}}
{{- .Values.cni.binDir | default (get $dirs (include "mesh-cni.platform" .)) -}}
{{- end -}}

{{- define "mesh-cni.cniConfDir" -}}
{{- $dirs := dict "default" "/etc/cni/net.d" "eks" "/etc/cni/net.d" "kind" "/etc/cni/net.d" "gke" "/etc/cni/net.d" "k3s" "/var/lib/rancher/k3s/agent/etc/cni/net.d" "microk8s" "/var/snap/microk8s/current/args/cni-network" "openshift" "/etc/kubernetes/cni/net.d" -}}
{{- .Values.cni.confDir | default (get $dirs (include "mesh-cni.platform" .)) -}}
{{- end -}}

{{/*
The CNI directory flags: only for a directory the operator named (cni.binDir,
cni.confDir), which the agent then installs into as named. Otherwise the agent
installs where the node's container runtime loads CNI from, through the mounts
when they are those directories (a platform's), or through the host's root.
*/}}
{{- define "mesh-cni.cniDirArgs" -}}
{{- if .Values.cni.binDir }}
- --cni-bin-dir=/opt/cni/bin
{{- end }}
{{- if .Values.cni.confDir }}
- --cni-conf-dir=/etc/cni/net.d
{{- end }}
{{- end -}}

{{/*
The host the kubelet probes: the metrics address, or loopback for a wildcard.
*/}}
{{- define "mesh-cni.probeHost" -}}
{{- if has .Values.metrics.bindAddress (list "0.0.0.0" "::") -}}
127.0.0.1
{{- else -}}
{{ .Values.metrics.bindAddress }}
{{- end -}}
{{- end -}}

{{/*
host:port for --metrics-addr, with IPv6 in brackets.
*/}}
{{- define "mesh-cni.metricsAddr" -}}
{{- if contains ":" .Values.metrics.bindAddress -}}
[{{ .Values.metrics.bindAddress }}]:{{ .Values.metrics.port }}
{{- else -}}
{{ .Values.metrics.bindAddress }}:{{ .Values.metrics.port }}
{{- end -}}
{{- end -}}

{{/*
Where the node's DaemonSets run, and how their images are pulled.
*/}}
{{- define "mesh-cni.scheduling" -}}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := .Values.tolerations }}
{{- if .Values.startupTaint.enabled }}
{{- $tolerations = append $tolerations (dict "key" .Values.startupTaint.key "operator" "Exists") }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
The users that may write a pod's redirection annotations, as a CEL list's
items: the agent's service account, then admissionPolicy.redirectionWriters.
*/}}
{{- define "mesh-cni.redirectionWriters" -}}
{{- $writers := list (printf "system:serviceaccount:%s:mesh-agent" .Release.Namespace) -}}
{{- range .Values.admissionPolicy.redirectionWriters -}}
{{- $writers = append $writers . -}}
{{- end -}}
{{- range $i, $w := $writers -}}
{{- if $i }}, {{ end -}}
'{{ $w }}'
{{- end -}}
{{- end -}}
