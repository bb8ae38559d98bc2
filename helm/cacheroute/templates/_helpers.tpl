{{/* Names and labels shared by every template. */}}

{{- define "cacheroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-<chart>, or the release name alone when it already holds the chart name. */}}
{{- define "cacheroute.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "cacheroute.operatorName" -}}
{{- printf "%s-operator" (include "cacheroute.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "cacheroute.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "cacheroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cacheroute
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "cacheroute.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "cacheroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "cacheroute.operatorLabels" -}}
{{ include "cacheroute.labels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "cacheroute.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "cacheroute.operatorName" .) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository:tag, or repository@digest when a digest is given. */}}
{{- define "cacheroute.image" -}}
{{- $image := .Values.operator.image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "cacheroute.routerImage" -}}
{{- default (include "cacheroute.image" .) .Values.router.image -}}
{{- end -}}

{{/* The namespaces the operator serves; fails early on a watch list that cannot work. */}}
{{- define "cacheroute.watchedNamespaces" -}}
{{- if not .Values.operator.watch.allNamespaces -}}
{{- if not .Values.operator.watch.namespaces -}}
{{- fail "operator.watch.namespaces must name at least one namespace when operator.watch.allNamespaces is false" -}}
{{- end -}}
{{- toJson .Values.operator.watch.namespaces -}}
{{- end -}}
{{- end -}}

{{/* The operator's configuration file (`--config`): router and engine defaults, as the operator reads them. */}}
{{- define "cacheroute.operatorConfig" -}}
{{- $router := deepCopy .Values.router -}}
{{- $_ := set $router "image" (include "cacheroute.routerImage" .) -}}
{{- $config := dict "clusterDomain" .Values.operator.clusterDomain "router" $router "engine" .Values.engine "profiling" .Values.operator.profiling -}}
{{- toYaml $config -}}
{{- end -}}
